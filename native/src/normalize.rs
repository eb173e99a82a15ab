//! Semantic hashing of arguments and results, byte for byte the same as `stream_app/core/normalize.py`
//! (the reference): the canonical JSON written here is what orjson writes for the normalised value.
//!
//! serde_json's map (no `preserve_order`) is a BTreeMap, so keys already come in code-point order,
//! orjson's `OPT_SORT_KEYS` order; the canonical bytes are written in one pass without building the
//! normalised tree.

use serde_json::{Map, Number, Value};
use sha2::{Digest, Sha256};

/// Nesting limit of the reference normaliser (`MAX_DEPTH`).
const MAX_DEPTH: usize = 64;
/// Floats that are whole numbers within +-2**53 hash as integers (`1.0` is `1` in every runtime).
const FLOAT_EXACT_INT: f64 = 9_007_199_254_740_992.0;

/// Why a value has no semantic hash.
pub enum HashError<E> {
    /// The reference raises `NormalisationError` (too deep): the caller fails closed.
    NotNormalisable,
    /// The field filter failed (a Python exception).
    Filter(E),
}

/// Whitespace as Python's `str.split()` sees it (wider than Unicode White_Space: it includes the
/// ASCII file, group, record and unit separators).
pub fn is_py_space(c: char) -> bool {
    matches!(c, '\t'..='\r' | '\u{1c}'..='\u{1f}' | ' ' | '\u{85}' | '\u{a0}' | '\u{1680}'
        | '\u{2000}'..='\u{200a}' | '\u{2028}' | '\u{2029}' | '\u{202f}' | '\u{205f}' | '\u{3000}')
}

/// SHA-256 of the canonical JSON of the normalised `value`; `ignored(key)` says which object keys are
/// noise. `scratch` is reused between calls.
pub fn semantic_hash<E>(
    value: &Value,
    ignored: &mut dyn FnMut(&str) -> Result<bool, E>,
    collapse: bool,
    scratch: &mut Vec<u8>,
) -> Result<[u8; 32], HashError<E>> {
    scratch.clear();
    write_value(scratch, value, ignored, collapse, 0)?;
    Ok(Sha256::digest(&scratch[..]).into())
}

fn write_value<E>(
    out: &mut Vec<u8>,
    value: &Value,
    ignored: &mut dyn FnMut(&str) -> Result<bool, E>,
    collapse: bool,
    depth: usize,
) -> Result<(), HashError<E>> {
    match value {
        Value::Null => out.extend_from_slice(b"null"),
        Value::Bool(true) => out.extend_from_slice(b"true"),
        Value::Bool(false) => out.extend_from_slice(b"false"),
        Value::Number(n) => write_number(out, n),
        Value::String(s) => write_text(out, s, collapse),
        Value::Object(map) => write_object(out, map, ignored, collapse, depth)?,
        Value::Array(items) => {
            if depth >= MAX_DEPTH {
                return Err(HashError::NotNormalisable);
            }
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_value(out, item, ignored, collapse, depth + 1)?;
            }
            out.push(b']');
        }
    }
    Ok(())
}

fn write_object<E>(
    out: &mut Vec<u8>,
    map: &Map<String, Value>,
    ignored: &mut dyn FnMut(&str) -> Result<bool, E>,
    collapse: bool,
    depth: usize,
) -> Result<(), HashError<E>> {
    if depth >= MAX_DEPTH {
        return Err(HashError::NotNormalisable);
    }
    out.push(b'{');
    let mut first = true;
    for (key, item) in map {
        if ignored(key).map_err(HashError::Filter)? {
            continue;
        }
        if !first {
            out.push(b',');
        }
        first = false;
        write_escaped(out, key);
        out.push(b':');
        write_value(out, item, ignored, collapse, depth + 1)?;
    }
    out.push(b'}');
    Ok(())
}

fn write_number(out: &mut Vec<u8>, n: &Number) {
    if let Some(u) = n.as_u64() {
        out.extend_from_slice(u.to_string().as_bytes());
    } else if let Some(i) = n.as_i64() {
        out.extend_from_slice(i.to_string().as_bytes());
    } else {
        // JSON numbers are finite; serde_json refuses what would overflow to infinity.
        let f = n.as_f64().unwrap_or(f64::NAN);
        if f.fract() == 0.0 && (-FLOAT_EXACT_INT..=FLOAT_EXACT_INT).contains(&f) {
            out.extend_from_slice((f as i64).to_string().as_bytes());
        } else {
            write_float(out, f);
        }
    }
}

/// A float as orjson writes it: ryu's shortest digits that round-trip (where two as short are as
/// near, ryu's pick, as orjson's: 562949953421312.2, where Rust's `{:e}` gives ...312.3), positional
/// when the decimal exponent is in -5..=15 (`0.00001`, `9500000000000000.0`), else `1.5e+16` / `1e-6`.
fn write_float(out: &mut Vec<u8>, f: f64) {
    let mut buffer = ryu::Buffer::new();
    let text = buffer.format_finite(f); // "-1.5e300", "1e-7", "0.1", "123456.789", "9007199254740994.0"
    let (sign, text) = match text.strip_prefix('-') {
        Some(rest) => ("-", rest),
        None => ("", text),
    };
    let (mantissa, shift) = match text.split_once('e') {
        Some((mantissa, exponent)) => (
            mantissa,
            exponent
                .parse::<i32>()
                .expect("ryu's exponent is an integer"),
        ),
        None => (text, 0),
    };
    let (whole_part, fraction) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    let all = [whole_part, fraction].concat();
    let leading = all.bytes().take_while(|b| *b == b'0').count();
    let digits = all[leading..].trim_end_matches('0');
    let digits = if digits.is_empty() { "0" } else { digits };
    // the decimal exponent of the first significant digit
    let exponent = whole_part.len() as i32 + shift - 1 - leading as i32;
    out.extend_from_slice(sign.as_bytes());
    if (-5..16).contains(&exponent) {
        if exponent < 0 {
            out.extend_from_slice(b"0.");
            out.extend(std::iter::repeat_n(b'0', (-exponent - 1) as usize));
            out.extend_from_slice(digits.as_bytes());
        } else {
            let whole = exponent as usize + 1;
            if digits.len() <= whole {
                out.extend_from_slice(digits.as_bytes());
                out.extend(std::iter::repeat_n(b'0', whole - digits.len()));
                out.extend_from_slice(b".0");
            } else {
                out.extend_from_slice(&digits.as_bytes()[..whole]);
                out.push(b'.');
                out.extend_from_slice(&digits.as_bytes()[whole..]);
            }
        }
    } else {
        out.extend_from_slice(&digits.as_bytes()[..1]);
        if digits.len() > 1 {
            out.push(b'.');
            out.extend_from_slice(&digits.as_bytes()[1..]);
        }
        out.push(b'e');
        if exponent >= 0 {
            out.push(b'+');
        }
        out.extend_from_slice(exponent.to_string().as_bytes());
    }
}

/// A string value: whitespace runs collapsed to one space and trimmed (`" ".join(s.split())`).
fn write_text(out: &mut Vec<u8>, s: &str, collapse: bool) {
    if !collapse {
        return write_escaped(out, s);
    }
    out.push(b'"');
    for (i, word) in s.split(is_py_space).filter(|w| !w.is_empty()).enumerate() {
        if i > 0 {
            out.push(b' ');
        }
        escape_into(out, word);
    }
    out.push(b'"');
}

fn write_escaped(out: &mut Vec<u8>, s: &str) {
    out.push(b'"');
    escape_into(out, s);
    out.push(b'"');
}

/// JSON string escaping as orjson does it: quote, backslash and control characters only.
fn escape_into(out: &mut Vec<u8>, s: &str) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let bytes = s.as_bytes();
    let mut start = 0;
    for (i, &b) in bytes.iter().enumerate() {
        let escape: &[u8] = match b {
            b'"' => b"\\\"",
            b'\\' => b"\\\\",
            b'\n' => b"\\n",
            b'\r' => b"\\r",
            b'\t' => b"\\t",
            0x08 => b"\\b",
            0x0c => b"\\f",
            0x00..=0x1f => {
                out.extend_from_slice(&bytes[start..i]);
                out.extend_from_slice(b"\\u00");
                out.push(HEX[(b >> 4) as usize]);
                out.push(HEX[(b & 0xf) as usize]);
                start = i + 1;
                continue;
            }
            _ => continue,
        };
        out.extend_from_slice(&bytes[start..i]);
        out.extend_from_slice(escape);
        start = i + 1;
    }
    out.extend_from_slice(&bytes[start..]);
}

/// Lowercase hex of a digest (the `args_hash`/`result_hash` text).
pub fn hex(digest: &[u8]) -> String {
    let mut text = Vec::with_capacity(digest.len() * 2);
    hex_into(&mut text, digest);
    String::from_utf8(text).expect("hex digits are ASCII")
}

/// `hex(bytes)` appended to `out` (a stored record's digests, without a string each).
pub fn hex_into(out: &mut Vec<u8>, bytes: &[u8]) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    out.reserve(bytes.len() * 2);
    for b in bytes {
        out.push(HEX[(b >> 4) as usize]);
        out.push(HEX[(b & 0xf) as usize]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn canonical(json: &str) -> String {
        let value: Value = serde_json::from_str(json).unwrap();
        let mut out = Vec::new();
        let mut never = |_: &str| Ok::<bool, ()>(false);
        write_value(&mut out, &value, &mut never, true, 0)
            .ok()
            .unwrap();
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn floats_are_written_as_orjson_writes_them() {
        // Expected strings taken from orjson 3.13.
        assert_eq!(
            canonical("[1e16, 1e-7, 0.1, 123456.789, 9007199254740994.0, 5e-324, -1.5e300]"),
            "[1e+16,1e-7,0.1,123456.789,9007199254740994.0,5e-324,-1.5e+300]"
        );
        assert_eq!(
            canonical("[1e-5, 1.25e-5, 1e-6, 9.5e15, 1.5e16]"),
            "[0.00001,0.0000125,1e-6,9500000000000000.0,1.5e+16]"
        );
        assert_eq!(canonical("[1.0, -0.0, 2.5e0, 1e2]"), "[1,0,2.5,100]");
        assert_eq!(canonical("[562949953421312.2]"), "[562949953421312.2]");
    }

    #[test]
    fn strings_are_collapsed_and_escaped_as_orjson_does() {
        assert_eq!(
            canonical("{\"b\": \"  a \\t b\\u001c c \", \"a\": \"\\u0001\\\"\\\\\\b\\f\u{7f}/\"}"),
            "{\"a\":\"\\u0001\\\"\\\\\\b \u{7f}/\",\"b\":\"a b c\"}"
        ); // \f is whitespace: collapsed
    }
}
