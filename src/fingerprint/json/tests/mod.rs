//! The canonical JSON form: RFC 8785's examples and published test data, numbers, strings,
//! objects, the reader as a whole, and property tests over random spellings of random values.

use super::number::es_decimal;
use super::*;

mod numbers;
mod objects;
mod properties;
mod reader;
mod rfc8785;
mod strings;

fn jcs(s: &str) -> Option<String> {
    canonical_json(s.as_bytes(), &[]).map(|v| String::from_utf8(v).unwrap())
}

/// What a spelling of a double canonicalises to: RFC 8785's form when the spelling is
/// that form's value. Rust breaks a tie between two shortest forms upwards where
/// ECMAScript picks the even digit (`1424953923781206.3` against `.2`, for the double
/// `…206.25`); that spelling is another decimal, so it is written exactly.
fn same_or_exact(spelling: &str, es: &str) -> String {
    if es_decimal(spelling.as_bytes()) == es_decimal(es.as_bytes()) {
        es.to_owned()
    } else {
        let d = es_decimal(spelling.as_bytes()).unwrap();
        let mut out = Vec::new();
        d.write_exact(&mut out);
        String::from_utf8(out).unwrap()
    }
}
