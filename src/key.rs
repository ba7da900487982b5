//! Reading the `Idempotency-Key` field.

use http::{HeaderMap, HeaderName};

/// The longest key accepted, in characters (after sf-string unquoting).
pub(crate) const MAX_KEY_LEN: usize = 255;

/// Why a key was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum KeyError {
    Multiple,
    Empty,
    TooLong,
    InvalidCharacters,
    MalformedString,
}

impl KeyError {
    pub(crate) fn detail(self) -> &'static str {
        match self {
            KeyError::Multiple => "the idempotency key was sent in more than one field line",
            KeyError::Empty => "the idempotency key is empty",
            KeyError::TooLong => "the idempotency key is longer than 255 characters",
            KeyError::InvalidCharacters => {
                "the idempotency key must be visible ASCII characters (0x21-0x7E)"
            }
            KeyError::MalformedString => "the idempotency key is not a valid RFC 8941 string",
        }
    }
}

/// Reads the key from `headers`: `Ok(None)` when absent.
///
/// Accepts a bare token (`abc`) and an RFC 8941 sf-string (`"abc"`), which mean the same key.
pub(crate) fn extract(headers: &HeaderMap, name: &HeaderName) -> Result<Option<String>, KeyError> {
    let mut values = headers.get_all(name).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(KeyError::Multiple);
    }
    parse(value.as_bytes()).map(Some)
}

fn parse(raw: &[u8]) -> Result<String, KeyError> {
    let key = match raw {
        [] => return Err(KeyError::Empty),
        [b'"', ..] => unquote(raw)?,
        _ => raw.to_vec(),
    };
    if key.is_empty() {
        return Err(KeyError::Empty);
    }
    if key.len() > MAX_KEY_LEN {
        return Err(KeyError::TooLong);
    }
    if !key.iter().all(|b| (0x21..=0x7e).contains(b)) {
        return Err(KeyError::InvalidCharacters);
    }
    // Checked above: every byte is visible ASCII.
    String::from_utf8(key).map_err(|_| KeyError::InvalidCharacters)
}

/// RFC 8941 section 4.2.5: `"` chars `"`, where `\"` and `\\` are the only escapes.
fn unquote(raw: &[u8]) -> Result<Vec<u8>, KeyError> {
    let inner = raw
        .strip_prefix(b"\"")
        .and_then(|r| r.strip_suffix(b"\""))
        .ok_or(KeyError::MalformedString)?;
    let mut out = Vec::with_capacity(inner.len());
    let mut bytes = inner.iter();
    while let Some(&b) = bytes.next() {
        match b {
            b'\\' => match bytes.next() {
                Some(&e @ (b'"' | b'\\')) => out.push(e),
                _ => return Err(KeyError::MalformedString),
            },
            b'"' => return Err(KeyError::MalformedString),
            0x20..=0x7e => out.push(b),
            _ => return Err(KeyError::InvalidCharacters),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn key(values: &[&[u8]]) -> Result<Option<String>, KeyError> {
        let mut h = HeaderMap::new();
        for v in values {
            h.append("idempotency-key", HeaderValue::from_bytes(v).unwrap());
        }
        extract(&h, &HeaderName::from_static("idempotency-key"))
    }

    #[test]
    fn bare_tokens_and_sf_strings_name_the_same_key() {
        assert_eq!(key(&[b"abc-123"]), Ok(Some("abc-123".into())));
        assert_eq!(key(&[b"\"abc-123\""]), Ok(Some("abc-123".into())));
        assert_eq!(key(&[br#""a\"b\\c""#]), Ok(Some(r#"a"b\c"#.into())));
        assert_eq!(key(&[]), Ok(None));
    }

    #[test]
    fn refuses_bad_keys() {
        assert_eq!(key(&[b""]), Err(KeyError::Empty));
        assert_eq!(key(&[b"\"\""]), Err(KeyError::Empty));
        assert_eq!(key(&[b"a", b"b"]), Err(KeyError::Multiple));
        assert_eq!(key(&[&[b'k'; 256]]), Err(KeyError::TooLong));
        assert_eq!(key(&[&[b'k'; 255]]).unwrap().unwrap().len(), 255);
        assert_eq!(key(&[b"has space"]), Err(KeyError::InvalidCharacters));
        assert_eq!(key(&[b"\"has space\""]), Err(KeyError::InvalidCharacters));
        assert_eq!(
            key(&["caf\u{e9}".as_bytes()]),
            Err(KeyError::InvalidCharacters)
        );
        assert_eq!(key(&[b"\"open"]), Err(KeyError::MalformedString));
        assert_eq!(key(&[br#""bad\escape""#]), Err(KeyError::MalformedString));
        assert_eq!(key(&[br#""a"b""#]), Err(KeyError::MalformedString));
    }
}
