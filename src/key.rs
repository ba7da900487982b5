//! Where the idempotency key comes from ([`Key`]), and the rules every key is held to.

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;

use bytes::Bytes;
use http::header::CONTENT_TYPE;
use http::{request, HeaderMap, HeaderName, HeaderValue};
use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

use crate::error::ConfigError;
use crate::fingerprint::{form, JsonPointer};

/// The longest key accepted, in characters (after sf-string unquoting).
pub(crate) const MAX_KEY_LEN: usize = 255;

type KeyFn = Arc<dyn Fn(&request::Parts, &Bytes) -> Option<String> + Send + Sync>;

/// Where the layer reads each request's idempotency key, and whether one is required; set
/// with [`IdempotencyLayer::with_key`](crate::IdempotencyLayer::with_key).
///
/// - [`Key::header`]: a request header (the default is the `Idempotency-Key` header). Read
///   before the body: a request without it is refused before anything is buffered.
/// - [`Key::json_pointer`]: a field of the JSON body (a webhook's event id, `/id`).
/// - [`Key::form_field`]: a field of an `application/x-www-form-urlencoded` body (a form
///   posted by a browser, or a Stripe-style API's `idempotency_key`).
/// - [`Key::joined`]: several headers and fields, joined unambiguously (Adyen's `eventCode`
///   and `pspReference`).
/// - [`Key::from_fn`]: a function of the request head and the buffered body.
///
/// A key that reads the body reads the one buffer the layer keeps anyway, after the body
/// limit and timeout: a body over the limit is `413` before its key is looked at. Every key,
/// wherever it comes from, is 1 to 255 visible ASCII characters (`0x21`-`0x7E`). A key that
/// is absent is `400` [`key-missing`](crate::problems#key-missing), or passes through
/// unprotected when the key is [`optional`](Key::optional); a key that is present and
/// breaks the rules is `400` [`key-invalid`](crate::problems#key-invalid), optional or
/// not. Both problems name where the key was expected.
///
/// ```
/// # fn main() -> Result<(), tower_idempotency::ConfigError> {
/// use http::HeaderName;
/// use tower_idempotency::{store::MemoryStore, IdempotencyLayer, Key, KeyPart};
///
/// // Stripe: the event's `id` in the body.
/// let stripe = Key::json_pointer("/id")?;
/// // GitHub: the delivery id in a header.
/// let github = Key::header(HeaderName::from_static("x-github-delivery"));
/// // A form field, as a browser posts it.
/// let form = Key::form_field("idempotency_key");
/// // Adyen: two fields of the one notification item.
/// let item = "/notificationItems/0/NotificationRequestItem";
/// let adyen = Key::joined([
///     KeyPart::json_pointer(&format!("{item}/eventCode"))?,
///     KeyPart::json_pointer(&format!("{item}/pspReference"))?,
/// ])?;
/// let layer = IdempotencyLayer::new(MemoryStore::new()).unscoped().with_key(stripe);
/// # drop((layer, github, form, adyen));
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
#[must_use]
pub struct Key {
    source: Source,
    optional: bool,
    noun: Option<Cow<'static, str>>,
}

#[derive(Clone)]
enum Source {
    One(KeyPart),
    Joined(Vec<KeyPart>),
    Fn(KeyFn),
}

/// One part of a [`Key::joined`] key: a header, a JSON field or a form field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyPart(Part);

#[derive(Debug, Clone, PartialEq, Eq)]
enum Part {
    Header(HeaderName),
    Pointer { pointer: JsonPointer, text: String },
    Form(String),
}

impl KeyPart {
    /// The value of request header `name`, read as [`Key::header`] reads it.
    pub fn header(name: HeaderName) -> Self {
        Self(Part::Header(name))
    }

    /// The JSON string or integer at `pointer` (RFC 6901) in the body, read as
    /// [`Key::json_pointer`] reads it.
    pub fn json_pointer(pointer: &str) -> Result<Self, ConfigError> {
        Ok(Self(Part::Pointer {
            pointer: JsonPointer::parse(pointer)?,
            text: pointer.to_owned(),
        }))
    }

    /// The form field `name` of the body, read as [`Key::form_field`] reads it.
    pub fn form_field(name: impl Into<String>) -> Self {
        Self(Part::Form(name.into()))
    }
}

impl Default for Key {
    /// The `Idempotency-Key` header, required.
    fn default() -> Self {
        Self::header(HeaderName::from_static("idempotency-key"))
    }
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("Key");
        match &self.source {
            Source::One(p) => d.field("source", p),
            Source::Joined(parts) => d.field("joined", parts),
            Source::Fn(_) => d.field("source", &"fn"),
        };
        d.field("optional", &self.optional)
            .field("noun", &self.noun)
            .finish()
    }
}

impl Key {
    fn of(source: Source) -> Self {
        Self {
            source,
            optional: false,
            noun: None,
        }
    }

    /// The key is request header `name`: a bare token, or an RFC 8941 string (`"abc"` is the
    /// key `abc`), sent in one field line. gRPC requests read the metadata entry of that name.
    pub fn header(name: HeaderName) -> Self {
        Self::of(Source::One(KeyPart::header(name)))
    }

    /// The key is the JSON value at `pointer` (RFC 6901, such as `/id` or
    /// `/data/object/id`) in the request body.
    ///
    /// A string is the key as it is (after JSON unescaping; no RFC 8941 unquoting). An
    /// integer is the key in decimal, so `123` and `"123"` are the same key; a number with
    /// a fraction or an exponent, or outside 64 bits, is refused (`key-invalid`), as are
    /// booleans, objects and arrays. `null`, a pointer that leads nowhere, and a body that is
    /// not JSON mean the key is missing. A member named twice on the pointer's path is
    /// refused: JSON parsers disagree on which one counts.
    ///
    /// Refused here: a pointer that does not start with `/` or has a bad `~` escape.
    pub fn json_pointer(pointer: &str) -> Result<Self, ConfigError> {
        Ok(Self::of(Source::One(KeyPart::json_pointer(pointer)?)))
    }

    /// The key is the field `name` of an `application/x-www-form-urlencoded` body, as
    /// browsers post forms and Stripe-style APIs take their parameters.
    ///
    /// Pairs are split on `&` and `=`, and names and values decoded as the form encoding
    /// says (`+` is a space, `%XX` a byte), so `idempotency%5Fkey=k%2D1` is the key `k-1`
    /// in the field `idempotency_key`. The value is the key as it is; it must decode: a bad
    /// percent-escape in it is refused (`key-invalid`), so that no key has two spellings. A
    /// field given twice is refused too (`key-invalid`): frameworks disagree on which one
    /// counts. A field that is absent, and a body of another media type (by its
    /// `Content-Type`, whose parameters are ignored; none at all included), mean the key is
    /// missing; the problem names the media type the request had.
    pub fn form_field(name: impl Into<String>) -> Self {
        Self::of(Source::One(KeyPart::form_field(name)))
    }

    /// The key is made of `parts`, in order, each read and checked as on its own (1 to 255
    /// visible ASCII characters), then joined unambiguously: each part as its length in
    /// decimal, `:`, and the part, so `("ab", "c")` is `2:ab1:c` and never the same as
    /// `("a", "bc")`, `1:a2:bc`. The joined key is held to 255 characters too, and it is the
    /// key [`IdempotencyContext::key`](crate::IdempotencyContext::key) returns. A missing
    /// part makes the key missing, and the problem names that part.
    ///
    /// Refused here: no parts.
    pub fn joined(parts: impl IntoIterator<Item = KeyPart>) -> Result<Self, ConfigError> {
        let parts: Vec<_> = parts.into_iter().collect();
        if parts.is_empty() {
            return Err(ConfigError::new("a joined key needs at least one part"));
        }
        Ok(Self::of(Source::Joined(parts)))
    }

    /// The key is what `f` makes of the request head and the buffered body: `None` when the
    /// request has none. The result is held to the same rules (1 to 255 visible ASCII
    /// characters) as any key. `f` runs on every protected request, on the request's task:
    /// keep it cheap, and never let it fail open to a constant key.
    pub fn from_fn<F>(f: F) -> Self
    where
        F: Fn(&request::Parts, &Bytes) -> Option<String> + Send + Sync + 'static,
    {
        Self::of(Source::Fn(Arc::new(f)))
    }

    /// A request without the key passes through unprotected (no claim, no record) instead of
    /// being refused with `400`. A key that is present but invalid is still `400`.
    pub fn optional(mut self) -> Self {
        self.optional = true;
        self
    }

    /// What the key is called in the problems the layer answers with (default "idempotency
    /// key"; a [`Webhook`](crate::Webhook) says "webhook id"), as in "the webhook id at JSON
    /// pointer `/id` in the request body is missing".
    pub fn described_as(mut self, noun: impl Into<Cow<'static, str>>) -> Self {
        self.noun = Some(noun.into());
        self
    }

    pub(crate) fn has_noun(&self) -> bool {
        self.noun.is_some()
    }

    pub(crate) fn is_optional(&self) -> bool {
        self.optional
    }

    /// Where the key is read, part by part, for an API description: each part's header
    /// name, or `None` and where in the body it is. `None` for a key from a function.
    #[cfg(feature = "utoipa")]
    pub(crate) fn places(&self) -> Option<Vec<(Option<HeaderName>, String)>> {
        let place = |p: &KeyPart| match &p.0 {
            Part::Header(name) => (Some(name.clone()), p.place(false)),
            _ => (None, p.place(false)),
        };
        match &self.source {
            Source::One(p) => Some(vec![place(p)]),
            Source::Joined(parts) => Some(parts.iter().map(place).collect()),
            Source::Fn(_) => None,
        }
    }

    /// Whether the key can only be read once the body is buffered.
    pub(crate) fn reads_body(&self) -> bool {
        match &self.source {
            Source::One(p) => p.reads_body(),
            Source::Joined(parts) => parts.iter().any(KeyPart::reads_body),
            Source::Fn(_) => true,
        }
    }

    /// The value to echo for `key`, read from `headers`: a key from one header as its field
    /// was sent, any other as it was read.
    pub(crate) fn echo(&self, headers: &HeaderMap, key: &str) -> Option<HeaderValue> {
        match &self.source {
            Source::One(KeyPart(Part::Header(name))) => headers.get(name).cloned(),
            _ => HeaderValue::from_str(key).ok(),
        }
    }

    fn noun(&self) -> &str {
        self.noun.as_deref().unwrap_or("idempotency key")
    }

    /// Reads a key that does not need the body (see [`reads_body`](Self::reads_body)).
    pub(crate) fn read_head(&self, headers: &HeaderMap, grpc: bool) -> Result<Arc<str>, Refusal> {
        self.read(headers, None, grpc)
    }

    /// Reads the key from the request and its buffered body.
    pub(crate) fn read_request(
        &self,
        parts: &request::Parts,
        body: &Bytes,
        grpc: bool,
    ) -> Result<Arc<str>, Refusal> {
        if let Source::Fn(f) = &self.source {
            let noun = self.noun();
            return match f(parts, body) {
                None => Err(Refusal::Missing(format!("this request has no {noun}"))),
                Some(key) => check(key.as_bytes()).map_err(|e| {
                    Refusal::Invalid(format!(
                        "the {noun} derived from this request {}",
                        e.reason()
                    ))
                }),
            };
        }
        self.read(&parts.headers, Some(body), grpc)
    }

    fn read(
        &self,
        headers: &HeaderMap,
        body: Option<&[u8]>,
        grpc: bool,
    ) -> Result<Arc<str>, Refusal> {
        let noun = self.noun();
        let refuse = |part: &KeyPart, e: PartError, joined: bool| {
            let place = part.place(grpc);
            let noun = if joined {
                format!("{noun} part")
            } else {
                noun.to_owned()
            };
            match (e, &part.0) {
                // The default header keeps the words clients already know.
                (PartError::Missing, Part::Header(h)) if self.noun.is_none() && !joined => {
                    let field = if grpc { "metadata entry" } else { "header" };
                    Refusal::Missing(format!("this request requires an `{h}` {field}"))
                }
                (PartError::Bad(e), Part::Header(_)) if self.noun.is_none() && !joined => {
                    Refusal::Invalid(e.detail().to_owned())
                }
                (PartError::Missing, _) => {
                    Refusal::Missing(format!("the {noun} {place} is missing"))
                }
                (PartError::NotJson, _) => Refusal::Missing(format!(
                    "the {noun} {place} is missing: the request body is not JSON"
                )),
                (PartError::NotForm(why), _) => {
                    Refusal::Missing(format!("the {noun} {place} is missing: {why}"))
                }
                (PartError::Bad(e), _) => {
                    Refusal::Invalid(format!("the {noun} {place} {}", e.reason()))
                }
            }
        };
        match &self.source {
            Source::One(part) => part.read(headers, body).map_err(|e| refuse(part, e, false)),
            Source::Joined(parts) => {
                let mut key = String::new();
                for part in parts {
                    let value = part
                        .read(headers, body)
                        .map_err(|e| refuse(part, e, true))?;
                    key.push_str(&value.len().to_string());
                    key.push(':');
                    key.push_str(&value);
                }
                if key.len() > MAX_KEY_LEN {
                    return Err(Refusal::Invalid(format!(
                        "the {noun} joined from its parts is longer than {MAX_KEY_LEN} characters"
                    )));
                }
                Ok(Arc::from(key))
            }
            Source::Fn(_) => unreachable!("a key from a function is read with the body"),
        }
    }
}

/// Why a request has no usable key: the problem's detail, naming where it was expected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Refusal {
    Missing(String),
    Invalid(String),
}

enum PartError {
    Missing,
    NotJson,
    /// Why the body is not a form, as the end of a sentence.
    NotForm(String),
    Bad(KeyError),
}

impl KeyPart {
    fn reads_body(&self) -> bool {
        matches!(self.0, Part::Pointer { .. } | Part::Form(_))
    }

    fn place(&self, grpc: bool) -> String {
        match &self.0 {
            Part::Header(h) if grpc => format!("in the `{h}` metadata entry"),
            Part::Header(h) => format!("in the `{h}` header"),
            Part::Pointer { text, .. } => format!("at JSON pointer `{text}` in the request body"),
            Part::Form(name) => format!("in form field `{name}` of the request body"),
        }
    }

    fn read(&self, headers: &HeaderMap, body: Option<&[u8]>) -> Result<Arc<str>, PartError> {
        match &self.0 {
            Part::Header(name) => match extract(headers, name) {
                Ok(Some(key)) => Ok(key),
                Ok(None) => Err(PartError::Missing),
                Err(e) => Err(PartError::Bad(e)),
            },
            Part::Pointer { pointer, .. } => {
                let body = body.expect("a body key is read after buffering");
                match json_at(body, pointer.tokens()) {
                    Err(()) => Err(PartError::NotJson),
                    Ok(Found::Absent) => Err(PartError::Missing),
                    Ok(Found::Duplicate) => Err(PartError::Bad(KeyError::Duplicate)),
                    Ok(Found::Other(kind)) => Err(PartError::Bad(KeyError::NotAnId(kind))),
                    Ok(Found::Str(s) | Found::Int(s)) => {
                        check(s.as_bytes()).map_err(PartError::Bad)
                    }
                }
            }
            Part::Form(name) => {
                let body = body.expect("a body key is read after buffering");
                if let Some(why) = not_a_form(headers) {
                    return Err(PartError::NotForm(why));
                }
                match form::field(body, name.as_bytes()) {
                    form::Field::Absent => Err(PartError::Missing),
                    form::Field::Repeated => Err(PartError::Bad(KeyError::Repeated)),
                    form::Field::One(None) => Err(PartError::Bad(KeyError::BadEscape)),
                    form::Field::One(Some(value)) => check(&value).map_err(PartError::Bad),
                }
            }
        }
    }
}

/// The form media type: a body under any other is not read as a form.
const FORM: &str = "application/x-www-form-urlencoded";

/// Why a request's body is not a form, or `None` when its one `Content-Type` is
/// [`FORM`] (in any case, with any parameters).
fn not_a_form(headers: &HeaderMap) -> Option<String> {
    let mut lines = headers.get_all(CONTENT_TYPE).iter();
    let Some(line) = lines.next() else {
        return Some(format!(
            "the request has no `Content-Type`, where `{FORM}` was expected"
        ));
    };
    if lines.next().is_some() {
        return Some(format!(
            "the request has more than one `Content-Type`, where `{FORM}` was expected"
        ));
    }
    let essence = line.as_bytes().split(|&b| b == b';').next().unwrap_or(&[]);
    let essence = String::from_utf8_lossy(essence.trim_ascii());
    if essence.eq_ignore_ascii_case(FORM) {
        return None;
    }
    // The client's own words go into the problem: bounded.
    let shown: String = essence.chars().take(64).collect();
    let more = if shown.len() < essence.len() {
        "…"
    } else {
        ""
    };
    Some(format!("the request body is `{shown}{more}`, not `{FORM}`"))
}

/// Why a key was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum KeyError {
    Multiple,
    Empty,
    TooLong,
    InvalidCharacters,
    MalformedString,
    /// A JSON value that is no id: what it is instead.
    NotAnId(&'static str),
    /// A JSON member on the pointer's path is named twice.
    Duplicate,
    /// A form field is given more than once.
    Repeated,
    /// A form value with a bad percent-escape.
    BadEscape,
}

impl KeyError {
    /// The detail of the default header's problems, unchanged since they were first written.
    pub(crate) fn detail(self) -> &'static str {
        match self {
            KeyError::Multiple => "the idempotency key was sent in more than one field line",
            KeyError::Empty => "the idempotency key is empty",
            KeyError::TooLong => "the idempotency key is longer than 255 characters",
            KeyError::InvalidCharacters => {
                "the idempotency key must be visible ASCII characters (0x21-0x7E)"
            }
            KeyError::MalformedString => "the idempotency key is not a valid RFC 8941 string",
            KeyError::NotAnId(_) => "the idempotency key is not a string or an integer",
            KeyError::Duplicate | KeyError::Repeated => {
                "the idempotency key appears more than once"
            }
            KeyError::BadEscape => "the idempotency key has a bad percent-escape",
        }
    }

    /// What is wrong, as the end of a sentence that starts by naming the key.
    fn reason(self) -> Cow<'static, str> {
        match self {
            KeyError::Multiple => "was sent in more than one field line".into(),
            KeyError::Empty => "is empty".into(),
            KeyError::TooLong => "is longer than 255 characters".into(),
            KeyError::InvalidCharacters => "must be visible ASCII characters (0x21-0x7E)".into(),
            KeyError::MalformedString => "is not a valid RFC 8941 string".into(),
            KeyError::NotAnId(kind) => format!("is {kind}, not a string or an integer").into(),
            KeyError::Duplicate => {
                "is named more than once in the JSON body, and parsers disagree on which counts"
                    .into()
            }
            KeyError::Repeated => {
                "is given more than once in the form body, and frameworks disagree on which counts"
                    .into()
            }
            KeyError::BadEscape => {
                "is not valid form encoding: a `%` must be followed by two hex digits".into()
            }
        }
    }
}

/// Reads the key from `headers`: `Ok(None)` when absent.
///
/// Accepts a bare token (`abc`) and an RFC 8941 sf-string (`"abc"`), which mean the same key.
pub(crate) fn extract(
    headers: &HeaderMap,
    name: &HeaderName,
) -> Result<Option<Arc<str>>, KeyError> {
    let mut values = headers.get_all(name).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(KeyError::Multiple);
    }
    parse(value.as_bytes()).map(Some)
}

/// A bare token is checked where it lies and copied once, into the key the layer shares.
fn parse(raw: &[u8]) -> Result<Arc<str>, KeyError> {
    match raw {
        [] => Err(KeyError::Empty),
        [b'"', ..] => check(&unquote(raw)?),
        _ => check(raw),
    }
}

/// The rules every key is held to, wherever it came from: the key, copied once into the
/// `Arc` the layer shares.
pub(crate) fn check(key: &[u8]) -> Result<Arc<str>, KeyError> {
    if key.is_empty() {
        return Err(KeyError::Empty);
    }
    if key.len() > MAX_KEY_LEN {
        return Err(KeyError::TooLong);
    }
    // A fold, not `all`: without the early exit the loop is vectorised, and a key is short.
    if !key
        .iter()
        .fold(true, |ok, b| ok & (0x21..=0x7e).contains(b))
    {
        return Err(KeyError::InvalidCharacters);
    }
    // Checked above: every byte is visible ASCII.
    std::str::from_utf8(key)
        .map(Arc::from)
        .map_err(|_| KeyError::InvalidCharacters)
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

/// What a JSON pointer found in a body.
#[derive(Debug, PartialEq, Eq)]
enum Found {
    Absent,
    Str(String),
    Int(String),
    Other(&'static str),
    Duplicate,
}

/// The value at `tokens` in `body`, or `Err` when `body` is not one JSON document.
///
/// One pass with `serde_json`, which skips every value off the path without building it;
/// it also checks the whole document's syntax (and UTF-8), as the fingerprint's reader does.
fn json_at(body: &[u8], tokens: &[String]) -> Result<Found, ()> {
    let mut de = serde_json::Deserializer::from_slice(body);
    let found = Find(tokens).deserialize(&mut de).map_err(drop)?;
    de.end().map_err(drop)?;
    Ok(found)
}

/// RFC 6901 array index: `0`, or digits without a leading zero.
fn array_index(token: &str) -> Option<usize> {
    let digits = token.bytes().all(|b| b.is_ascii_digit());
    if !digits || token.is_empty() || (token.len() > 1 && token.starts_with('0')) {
        return None;
    }
    token.parse().ok()
}

/// Walks down `self.0`, one token per level.
struct Find<'p>(&'p [String]);

impl<'de> DeserializeSeed<'de> for Find<'_> {
    type Value = Found;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Found, D::Error> {
        d.deserialize_any(self)
    }
}

impl Find<'_> {
    fn leaf(&self, found: Found) -> Found {
        if self.0.is_empty() {
            found
        } else {
            Found::Absent
        }
    }
}

impl<'de> Visitor<'de> for Find<'_> {
    type Value = Found;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_str<E>(self, v: &str) -> Result<Found, E> {
        Ok(self.leaf(Found::Str(v.to_owned())))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Found, E> {
        Ok(self.leaf(Found::Int(v.to_string())))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Found, E> {
        Ok(self.leaf(Found::Int(v.to_string())))
    }

    fn visit_f64<E>(self, _: f64) -> Result<Found, E> {
        Ok(self.leaf(Found::Other(
            "a number with a fraction or an exponent, or beyond 64 bits",
        )))
    }

    fn visit_bool<E>(self, _: bool) -> Result<Found, E> {
        Ok(self.leaf(Found::Other("a boolean")))
    }

    fn visit_unit<E>(self) -> Result<Found, E> {
        Ok(Found::Absent)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Found, A::Error> {
        let Some((first, rest)) = self.0.split_first() else {
            while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
            return Ok(Found::Other("an object"));
        };
        let mut found = None;
        while let Some(key) = map.next_key::<Cow<'de, str>>()? {
            if key == first.as_str() {
                let value = map.next_value_seed(Find(rest))?;
                found = Some(if found.is_some() {
                    Found::Duplicate
                } else {
                    value
                });
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(found.unwrap_or(Found::Absent))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Found, A::Error> {
        let Some((first, rest)) = self.0.split_first() else {
            while seq.next_element::<IgnoredAny>()?.is_some() {}
            return Ok(Found::Other("an array"));
        };
        let index = array_index(first);
        let mut found = Found::Absent;
        for i in 0.. {
            if Some(i) == index {
                match seq.next_element_seed(Find(rest))? {
                    Some(v) => found = v,
                    None => break,
                }
            } else if seq.next_element::<IgnoredAny>()?.is_none() {
                break;
            }
        }
        Ok(found)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(values: &[&[u8]]) -> Result<Option<String>, KeyError> {
        let mut h = HeaderMap::new();
        for v in values {
            h.append("idempotency-key", HeaderValue::from_bytes(v).unwrap());
        }
        extract(&h, &HeaderName::from_static("idempotency-key")).map(|k| k.map(|k| k.to_string()))
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

    #[test]
    fn json_pointers_follow_rfc_6901_indices_and_report_what_they_find() {
        let at =
            |body: &str, p: &str| json_at(body.as_bytes(), JsonPointer::parse(p).unwrap().tokens());
        assert_eq!(at(r#"{"a":["x","y"]}"#, "/a/1"), Ok(Found::Str("y".into())));
        for index in ["+1", "01", "-", "1.0", ""] {
            assert_eq!(
                at(r#"{"a":["x","y"]}"#, &format!("/a/{index}")),
                Ok(Found::Absent),
                "{index:?}"
            );
        }
        assert_eq!(at(r#"{"a":{"":"e"}}"#, "/a/"), Ok(Found::Str("e".into())));
        assert_eq!(
            at(r#"{"a":18446744073709551615}"#, "/a"),
            Ok(Found::Int(u64::MAX.to_string()))
        );
        assert_eq!(at(r#"{"a":"x"}{}"#, "/a"), Err(()));
        // Invalid UTF-8 in a string is not JSON.
        assert_eq!(json_at(b"{\"a\":\"\xff\"}", &["a".to_owned()]), Err(()));
    }
}
