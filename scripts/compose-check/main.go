// compose-check loads compose files the way `docker compose config` does, with compose-go's
// ProjectOptions.LoadProject: schema validation, interpolation, path resolution, normalisation and the
// consistency checks (every depends_on, network, volume, secret and config a service names exists).
// It prints the resolved project as JSON, every profile enabled; on an invalid file it prints the
// loader's error and exits 1. Built by scripts/install-deploy-tools; the Docker CLI here has no compose
// plugin and there is no engine, and neither is needed to load a file.
//
//	compose-check [-profile NAME ...] [FILE ...]   (default: the compose file of the current directory)
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"strings"

	"github.com/compose-spec/compose-go/v2/cli"
)

func main() {
	profiles := flag.String("profiles", "*", "comma-separated profiles to enable (* for all)")
	flag.Parse()

	wd, err := os.Getwd()
	if err != nil {
		fail(err)
	}
	options, err := cli.NewProjectOptions(flag.Args(),
		cli.WithWorkingDirectory(wd),
		cli.WithOsEnv,
		cli.WithDotEnv,
		cli.WithConfigFileEnv,
		cli.WithDefaultConfigPath,
		cli.WithInterpolation(true),
		cli.WithResolvedPaths(true),
		cli.WithNormalization(true),
		cli.WithConsistency(true),
		cli.WithProfiles(strings.Split(*profiles, ",")),
	)
	if err != nil {
		fail(err)
	}
	project, err := options.LoadProject(context.Background())
	if err != nil {
		fail(err)
	}
	out, err := json.MarshalIndent(project, "", "  ")
	if err != nil {
		fail(err)
	}
	fmt.Println(string(out))
}

func fail(err error) {
	fmt.Fprintf(os.Stderr, "compose-check: %v\n", err)
	os.Exit(1)
}
