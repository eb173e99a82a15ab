"""Framework guards (optional extras): each maps an agent framework's tool-call hooks onto the Guard."""
