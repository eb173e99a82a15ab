//! A JSON object's top-level fields, read by name: a telemetry event (`contract::decode`) and a stored
//! run record (`RunState::from_record`).
//!
//! serde_json's `Map` keeps its fields sorted in a tree, each name an owned string: parsing one allocates
//! a string and a node per field, and every look-up compares strings down the tree. Building and
//! dropping those maps was about half of the batch fold's time (perf, the bench's corpus). `FlatObject`
//! keeps the fields in text order with their names borrowed from the text. Where its reading could differ
//! from the map's (a repeated name: the map keeps the last) or fail, it declines and the map reads the
//! text: `Object::parse` gives the same fields either way. Readers take each field by name, or each
//! field once in no set order (`try_each`): neither depends on the order of the fields.

use serde_json::{Map, Value};

/// Top-level fields by name, and each field once.
pub trait Fields {
    fn field(&self, name: &str) -> Option<&Value>;
    /// `f` on each field (each name once, in no set order) until it returns None (then None).
    fn try_each<'s>(&'s self, f: impl FnMut(&'s str, &'s Value) -> Option<()>) -> Option<()>;
}

impl Fields for Map<String, Value> {
    fn field(&self, name: &str) -> Option<&Value> {
        self.get(name)
    }
    fn try_each<'s>(&'s self, mut f: impl FnMut(&'s str, &'s Value) -> Option<()>) -> Option<()> {
        for (name, value) in self {
            f(name, value)?;
        }
        Some(())
    }
}

/// An object's fields in text order, names borrowed from the text, each name once.
pub struct FlatObject<'a>(Vec<(&'a str, Value)>);

impl<'a> FlatObject<'a> {
    /// None where the map's reading could differ or fail: not an object, a name with an escape (it
    /// cannot be borrowed), a repeated name (the map keeps the last), anything after the object, text
    /// that is not JSON.
    pub fn parse(raw: &'a [u8]) -> Option<FlatObject<'a>> {
        use serde::de::{Deserializer, MapAccess, Visitor};

        struct Entries;
        impl<'de> Visitor<'de> for Entries {
            type Value = Vec<(&'de str, Value)>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut entries: Vec<(&'de str, Value)> = Vec::with_capacity(32);
                while let Some((name, value)) = map.next_entry::<&'de str, Value>()? {
                    if entries.iter().any(|(other, _)| *other == name) {
                        return Err(serde::de::Error::custom("a repeated name"));
                    }
                    entries.push((name, value));
                }
                Ok(entries)
            }
        }
        let mut deserializer = serde_json::Deserializer::from_slice(raw);
        let entries = deserializer.deserialize_map(Entries).ok()?;
        deserializer.end().ok()?;
        Some(FlatObject(entries))
    }
}

impl Fields for FlatObject<'_> {
    fn field(&self, name: &str) -> Option<&Value> {
        self.0
            .iter()
            .find(|(key, _)| *key == name)
            .map(|(_, value)| value)
    }
    fn try_each<'s>(&'s self, mut f: impl FnMut(&'s str, &'s Value) -> Option<()>) -> Option<()> {
        for (name, value) in &self.0 {
            f(name, value)?;
        }
        Some(())
    }
}

/// A JSON object read flat, or as serde_json's map where the flat reading declines.
pub enum Object<'a> {
    Flat(FlatObject<'a>),
    Map(Map<String, Value>),
}

impl<'a> Object<'a> {
    /// The object `raw` holds; None if it is not JSON or not an object (as `serde_json::from_slice`).
    pub fn parse(raw: &'a [u8]) -> Option<Object<'a>> {
        if let Some(flat) = FlatObject::parse(raw) {
            return Some(Object::Flat(flat));
        }
        match serde_json::from_slice::<Value>(raw) {
            Ok(Value::Object(map)) => Some(Object::Map(map)),
            _ => None,
        }
    }
}

impl Fields for Object<'_> {
    fn field(&self, name: &str) -> Option<&Value> {
        match self {
            Object::Flat(flat) => flat.field(name),
            Object::Map(map) => map.field(name),
        }
    }
    fn try_each<'s>(&'s self, f: impl FnMut(&'s str, &'s Value) -> Option<()>) -> Option<()> {
        match self {
            Object::Flat(flat) => flat.try_each(f),
            Object::Map(map) => map.try_each(f),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every field of `fields`, sorted by name (each name once).
    fn all<F: Fields>(fields: &F) -> Vec<(String, Value)> {
        let mut out = Vec::new();
        fields.try_each(|name, value| {
            out.push((name.to_owned(), value.clone()));
            Some(())
        });
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    #[test]
    fn an_object_has_the_fields_the_map_has() {
        let texts = [
            r#"{"run_id":"r-1","ts_ms":5,"args":{"q":[1,2.5,"x"]},"tool":"search","n":null}"#,
            r#"{"a":1,"b":2,"a":3}"#, // repeated: the map keeps the last
            r#"{"b":1,"ba":2,"ab":3,"aa":4,"bb":5,"a":6}"#, // names alike in length and ends
            r#"{"tool":"s\u00e9arch","t\u006fol":"x"}"#, // an escaped name, repeating another
            r#" { "spaced" : true } "#,
            r#"{}"#,
        ];
        for text in texts {
            let Ok(Value::Object(map)) = serde_json::from_str::<Value>(text) else {
                panic!("{text}")
            };
            let object = Object::parse(text.as_bytes()).expect(text);
            assert_eq!(all(&object), all(&map), "{text}");
            for (name, value) in &map {
                assert_eq!(object.field(name), Some(value), "{text} {name}");
            }
            assert_eq!(object.field("absent"), None);
        }
        assert!(matches!(
            Object::parse(br#"{"a":1,"b":2,"a":3}"#),
            Some(Object::Map(_))
        ));
        assert!(matches!(
            Object::parse(br#"{"a":1,"b":2}"#),
            Some(Object::Flat(_))
        ));
        for refused in [&b"[1]"[..], b"{\"a\":1} {}", b"{\"a\":", b"", b"null"] {
            assert!(Object::parse(refused).is_none(), "{refused:?}");
        }
    }

    #[test]
    fn try_each_stops_at_the_first_none() {
        let object = Object::parse(br#"{"a":1,"b":2,"c":3}"#).unwrap();
        let mut seen = 0;
        let result = object.try_each(|_, _| {
            seen += 1;
            if seen == 2 {
                None
            } else {
                Some(())
            }
        });
        assert_eq!((result, seen), (None, 2));
    }
}
