//! The layer's contract in an OpenAPI document (the `utoipa` feature): the key parameter, the
//! replay header and the problem responses, on the operations the layer covers.
//!
//! A utoipa user describes the handlers; [`document`] adds what the layer adds in front of
//! them, read from the layer's own configuration, so the document cannot drift from it:
//!
//! - the key's header parameter (`Idempotency-Key`, or the header
//!   [`IdempotencyLayer::with_key`] names), required unless the key is
//!   [optional](crate::Key::optional). A key read from the body has no parameter: the
//!   operation's description says where it is read;
//! - `Idempotent-Replayed` on every success response (`2XX`), and `Idempotency-Key-TTL` and
//!   the echoed `Idempotency-Key` when [`IdempotencyLayer::with_ttl_header`] and
//!   [`IdempotencyLayer::with_key_echo`] are on;
//! - the layer's problem responses (`400`, `408`, `409`, `410`, `413`, `422`, `429`, `503`,
//!   and `401` for a [Standard Webhooks](crate::Webhook::standard) receiver), as
//!   `application/problem+json` referencing one [`PROBLEM_SCHEMA`] component, with
//!   `Retry-After` and `retry-after-ms` where the layer sends them. A [`Webhook`](crate::Webhook)'s
//!   in-progress status replaces the `409`.
//!
//! Only the methods the layer protects ([`IdempotencyLayer::with_methods`]; `POST` and
//! `PATCH` by default) are touched, and of those only the operations the `covers` predicate
//! selects: the layer's own [filter](IdempotencyLayer::with_filter) sees requests, not path
//! templates, so the routes it leaves out must be left out here too.
//!
//! ```
//! use http::Method;
//! use tower_idempotency::{openapi, store::MemoryStore, IdempotencyLayer};
//! use utoipa::openapi::path::{HttpMethod, OperationBuilder, PathItem};
//! use utoipa::openapi::{InfoBuilder, OpenApiBuilder, PathsBuilder, ResponseBuilder};
//!
//! let layer = IdempotencyLayer::new(MemoryStore::new()).unscoped();
//! let pay = OperationBuilder::new()
//!     .response("201", ResponseBuilder::new().description("The payment"));
//! let mut doc = OpenApiBuilder::new()
//!     .info(InfoBuilder::new().title("shop").version("1").build())
//!     .paths(PathsBuilder::new().path("/v1/payments", PathItem::new(HttpMethod::Post, pay)))
//!     .build();
//!
//! openapi::document(&mut doc, &layer, |path, _method: &Method| path.starts_with("/v1/"));
//!
//! let json = serde_json::to_value(&doc).unwrap();
//! let post = &json["paths"]["/v1/payments"]["post"];
//! assert_eq!(post["parameters"][0]["name"], "Idempotency-Key");
//! assert_eq!(post["parameters"][0]["required"], true);
//! assert!(post["responses"]["201"]["headers"]["Idempotent-Replayed"].is_object());
//! assert_eq!(
//!     post["responses"]["409"]["content"]["application/problem+json"]["schema"]["$ref"],
//!     "#/components/schemas/Problem"
//! );
//! ```
//!
//! Problems are described as the layer renders them; a layer with an
//! [error renderer](IdempotencyLayer::with_error_renderer) of its own answers in its own
//! shape, which this description does not know. Responses given as a `$ref` are left as
//! they are.

use std::collections::BTreeMap;

use http::{HeaderName, Method};
use utoipa::openapi::header::Header;
use utoipa::openapi::path::{Operation, ParameterBuilder, ParameterIn, PathItem};
use utoipa::openapi::schema::{ObjectBuilder, SchemaFormat, Type};
use utoipa::openapi::{Components, Content, OpenApi, Ref, RefOr, Required, Response, Schema};

use crate::config::Config;
use crate::error::ErrorKind;
use crate::layer::IdempotencyLayer;

/// The name of the schema component the problem responses reference:
/// `#/components/schemas/Problem`. A document that already has one keeps its own.
pub const PROBLEM_SCHEMA: &str = "Problem";

const PROBLEM_JSON: &str = "application/problem+json";

/// Adds the layer's contract to every operation of `openapi` that `layer` protects (its
/// methods) and `covers` selects, by path template (as written in the document, such as
/// `/v1/orders/{id}`) and method. See the [module docs](self) for what is added.
///
/// Running it twice adds nothing the second time: parameters, headers and problem content
/// already present are left alone.
pub fn document<F>(openapi: &mut OpenApi, layer: &IdempotencyLayer, covers: F)
where
    F: Fn(&str, &Method) -> bool,
{
    let config = &*layer.config;
    let mut touched = false;
    for (path, item) in openapi.paths.paths.iter_mut() {
        for method in &config.methods {
            if !covers(path, method) {
                continue;
            }
            if let Some(op) = operation_mut(item, method) {
                describe(op, config);
                touched = true;
            }
        }
    }
    if touched {
        openapi
            .components
            .get_or_insert_with(Components::new)
            .schemas
            .entry(PROBLEM_SCHEMA.to_owned())
            .or_insert_with(problem_schema);
    }
}

/// The operation of `item` for `method`, where OpenAPI has a field for it.
fn operation_mut<'a>(item: &'a mut PathItem, method: &Method) -> Option<&'a mut Operation> {
    let slot = match *method {
        Method::GET => &mut item.get,
        Method::PUT => &mut item.put,
        Method::POST => &mut item.post,
        Method::DELETE => &mut item.delete,
        Method::OPTIONS => &mut item.options,
        Method::HEAD => &mut item.head,
        Method::PATCH => &mut item.patch,
        Method::TRACE => &mut item.trace,
        _ => return None,
    };
    slot.as_mut()
}

fn describe(op: &mut Operation, config: &Config) {
    key_parameters(op, config);
    success_headers(op, config);
    problem_responses(op, config);
}

/// The key's header parameters, or a sentence on where in the body it is read.
fn key_parameters(op: &mut Operation, config: &Config) {
    let key = &config.key;
    let required = !key.is_optional();
    let need = if required {
        "Required"
    } else {
        "Optional: a request without it runs unprotected, once per attempt"
    };
    let Some(places) = key.places() else {
        note(
            op,
            &format!(
                "**Idempotency key:** derived from the request by the server. {need}; \
                 a retry with the same request is answered once."
            ),
        );
        return;
    };
    let joined = places.len() > 1;
    let mut body_places = Vec::new();
    for (header, place) in places {
        let Some(name) = header else {
            body_places.push(place);
            continue;
        };
        let params = op.parameters.get_or_insert_with(Vec::new);
        if params.iter().any(|p| {
            p.parameter_in == ParameterIn::Header && p.name.eq_ignore_ascii_case(name.as_str())
        }) {
            continue;
        }
        let what = if joined {
            "One part of the idempotency key, joined with the others"
        } else {
            "The idempotency key: a unique value per operation (a UUID), sent unchanged on \
             every retry of it"
        };
        let description = format!(
            "{what}. 1 to 255 visible ASCII characters, as a bare token or an RFC 8941 \
             string. {need}. The same key with a different request is answered `422`."
        );
        params.push(
            ParameterBuilder::new()
                .name(header_case(&name))
                .parameter_in(ParameterIn::Header)
                .required(if required {
                    Required::True
                } else {
                    Required::False
                })
                .description(Some(description))
                .schema(Some(
                    ObjectBuilder::new()
                        .schema_type(Type::String)
                        .min_length(Some(1))
                        .examples(["5f0c3a52-8d1e-4e0b-9a59-3f6d2d1c7b10"]),
                ))
                .build(),
        );
    }
    if !body_places.is_empty() {
        note(
            op,
            &format!(
                "**Idempotency key:** read {} ({}). {need}.",
                body_places.join(", "),
                if joined {
                    "parts of one key"
                } else {
                    "1 to 255 visible ASCII characters, or an integer"
                }
            ),
        );
    }
}

/// Appends a paragraph to the operation's description.
fn note(op: &mut Operation, text: &str) {
    match &mut op.description {
        Some(d) if d.contains(text) => {}
        Some(d) => {
            d.push_str("\n\n");
            d.push_str(text);
        }
        None => op.description = Some(text.to_owned()),
    }
}

/// `Idempotency-Key` for `idempotency-key`: header names are case-insensitive, and documents
/// and SDK generators show them capitalised.
fn header_case(name: &HeaderName) -> String {
    name.as_str()
        .split('-')
        .map(|w| {
            let mut c = w.chars();
            c.next()
                .map(|f| f.to_ascii_uppercase().to_string() + c.as_str())
                .unwrap_or_default()
        })
        .collect::<Vec<_>>()
        .join("-")
}

fn string_header(description: &str) -> Header {
    let mut h = Header::new(ObjectBuilder::new().schema_type(Type::String));
    h.description = Some(description.to_owned());
    h
}

fn integer_header(description: &str) -> Header {
    let mut h = Header::new(
        ObjectBuilder::new()
            .schema_type(Type::Integer)
            .minimum(Some(1)),
    );
    h.description = Some(description.to_owned());
    h
}

fn echo_header(config: &Config) -> Option<(String, Header)> {
    config.key_echo.then(|| {
        (
            "Idempotency-Key".to_owned(),
            string_header("The request's idempotency key, echoed."),
        )
    })
}

/// The replay marker (and the TTL and the key echo, when on) on every success response.
fn success_headers(op: &mut Operation, config: &Config) {
    let mut headers = vec![("Idempotent-Replayed".to_owned(), {
        let mut h = Header::new(
            ObjectBuilder::new()
                .schema_type(Type::String)
                .enum_values(Some(["true"])),
        );
        h.description = Some(
            "`true` on an answer replayed from the idempotency store: the first answer \
                 to this key, byte for byte. Absent on the answer that ran the operation."
                .to_owned(),
        );
        h
    })];
    if config.ttl_header {
        headers.push((
            "Idempotency-Key-TTL".to_owned(),
            integer_header("How long, in seconds, the server keeps the key and its answer."),
        ));
    }
    headers.extend(echo_header(config));
    for (status, response) in op.responses.responses.iter_mut() {
        let RefOr::T(response) = response else {
            continue;
        };
        if !status.starts_with('2') {
            continue;
        }
        for (name, header) in &headers {
            if !has_header(response, name) {
                response.headers.insert(name.clone(), header.clone());
            }
        }
    }
}

fn has_header(response: &Response, name: &str) -> bool {
    response
        .headers
        .keys()
        .any(|h| h.eq_ignore_ascii_case(name))
}

/// The problems the layer can answer this configuration with, by status.
fn problem_kinds(config: &Config) -> BTreeMap<u16, Vec<ErrorKind>> {
    let mut kinds = vec![
        ErrorKind::KeyInvalid,
        ErrorKind::BodyUnreadable,
        ErrorKind::BodyTimeout,
        ErrorKind::BodyTooLarge,
        ErrorKind::InProgress,
        ErrorKind::Mismatch,
        ErrorKind::QuotaExceeded,
        ErrorKind::StoreUnavailable,
    ];
    if !config.key.is_optional() {
        kinds.insert(0, ErrorKind::KeyMissing);
    }
    if !config.unkept_as_status {
        kinds.push(ErrorKind::ResponseNotRetained);
    }
    if config.signature.is_some() {
        kinds.push(ErrorKind::SignatureInvalid);
    }
    let mut by_status: BTreeMap<u16, Vec<ErrorKind>> = BTreeMap::new();
    for kind in kinds {
        let status = match kind {
            ErrorKind::InProgress => config.in_progress_status,
            _ => kind.status(),
        };
        by_status.entry(status.as_u16()).or_default().push(kind);
    }
    by_status
}

fn retries(kind: ErrorKind) -> bool {
    matches!(
        kind,
        ErrorKind::InProgress | ErrorKind::QuotaExceeded | ErrorKind::StoreUnavailable
    )
}

/// One problem response per status: new where the operation has none, or merged into its
/// own (its content for `application/problem+json` and the retry headers, added if absent).
fn problem_responses(op: &mut Operation, config: &Config) {
    for (status, kinds) in problem_kinds(config) {
        let said: Vec<String> = kinds
            .iter()
            .map(|k| format!("{} (`{}`)", k.title(), k.type_uri()))
            .collect();
        let from_layer = format!("From the idempotency layer: {}.", said.join("; "));
        let entry = op
            .responses
            .responses
            .entry(status.to_string())
            .or_insert_with(|| RefOr::T(Response::new("")));
        let RefOr::T(response) = entry else {
            continue;
        };
        if response.description.is_empty() {
            response.description = from_layer;
        } else if !response.description.contains(&from_layer) {
            response.description.push_str("\n\n");
            response.description.push_str(&from_layer);
        }
        response
            .content
            .entry(PROBLEM_JSON.to_owned())
            .or_insert_with(|| Content::new(Some(Ref::from_schema_name(PROBLEM_SCHEMA))));
        let mut headers = Vec::new();
        if kinds.iter().copied().any(retries) {
            headers.push((
                "Retry-After".to_owned(),
                integer_header("When to retry, in whole seconds (rounded up)."),
            ));
            headers.push((
                "retry-after-ms".to_owned(),
                integer_header("The same hint in milliseconds, read first by some SDKs."),
            ));
        }
        // The key is known, and echoed, on every problem but the ones about the key itself.
        if kinds
            .iter()
            .any(|k| !matches!(k, ErrorKind::KeyMissing | ErrorKind::KeyInvalid))
        {
            headers.extend(echo_header(config));
        }
        for (name, header) in headers {
            if !has_header(response, &name) {
                response.headers.insert(name, header);
            }
        }
    }
}

/// RFC 9457's members, as the layer writes them, and the two it adds.
fn problem_schema() -> RefOr<Schema> {
    let string = |description: &str| {
        ObjectBuilder::new()
            .schema_type(Type::String)
            .description(Some(description))
    };
    let integer = |description: &str| {
        ObjectBuilder::new()
            .schema_type(Type::Integer)
            .description(Some(description))
    };
    ObjectBuilder::new()
        .schema_type(Type::Object)
        .description(Some(
            "An RFC 9457 problem. The idempotency layer's `type`s are stable URIs, one per \
             kind, each pointing at its explanation.",
        ))
        .property(
            "type",
            string("A URI that names the kind of problem.")
                .format(Some(SchemaFormat::Custom("uri-reference".to_owned()))),
        )
        .required("type")
        .property("title", string("A short summary of the kind."))
        .required("title")
        .property("status", integer("The HTTP status, repeated."))
        .required("status")
        .property("detail", string("What went wrong with this request."))
        .required("detail")
        .property(
            "retry_after",
            integer("When to retry, in seconds, as `Retry-After` (`in-progress`, `quota-exceeded`, `store-unavailable`).")
                .minimum(Some(1)),
        )
        .property(
            "original_status",
            integer("The status the original request answered with (`response-not-retained`)."),
        )
        .into()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemoryStore;
    use crate::{Key, Webhook};
    use utoipa::openapi::path::{HttpMethod, OperationBuilder};
    use utoipa::openapi::{OpenApiBuilder, PathsBuilder, ResponseBuilder};

    fn doc() -> OpenApi {
        let op = || {
            OperationBuilder::new()
                .response("201", ResponseBuilder::new().description("created"))
                .response("400", ResponseBuilder::new().description("bad body"))
        };
        let mut item = PathItem::new(HttpMethod::Post, op());
        item.get = Some(op().build());
        OpenApiBuilder::new()
            .paths(PathsBuilder::new().path("/things", item))
            .build()
    }

    fn json(doc: &OpenApi) -> serde_json::Value {
        serde_json::to_value(doc).unwrap()
    }

    #[test]
    fn another_key_header_is_the_parameter_and_optional_keys_are_not_required() {
        let layer = IdempotencyLayer::new(MemoryStore::new())
            .with_key(Key::header(HeaderName::from_static("x-request-key")).optional());
        let mut d = doc();
        document(&mut d, &layer, |_, _| true);
        let post = &json(&d)["paths"]["/things"]["post"];
        assert_eq!(post["parameters"].as_array().unwrap().len(), 1);
        assert_eq!(post["parameters"][0]["name"], "X-Request-Key");
        assert_eq!(post["parameters"][0]["required"], false);
        // Without a required key, there is no key-missing problem.
        assert!(!post["responses"]["400"]["description"]
            .as_str()
            .unwrap()
            .contains("key-missing"));
    }

    #[test]
    fn a_body_key_is_described_and_adds_no_header() {
        let layer =
            IdempotencyLayer::new(MemoryStore::new()).with_key(Key::json_pointer("/id").unwrap());
        let mut d = doc();
        document(&mut d, &layer, |_, _| true);
        let post = &json(&d)["paths"]["/things"]["post"];
        assert!(post["parameters"].is_null());
        assert!(post["description"]
            .as_str()
            .unwrap()
            .contains("at JSON pointer `/id` in the request body"));
    }

    #[test]
    fn an_existing_response_keeps_its_description_and_gains_the_problem_content() {
        let layer = IdempotencyLayer::new(MemoryStore::new());
        let mut d = doc();
        document(&mut d, &layer, |_, _| true);
        let once = json(&d);
        let r400 = &once["paths"]["/things"]["post"]["responses"]["400"];
        assert!(r400["description"]
            .as_str()
            .unwrap()
            .starts_with("bad body\n\n"));
        assert!(r400["content"][PROBLEM_JSON]["schema"]["$ref"].is_string());
        // Idempotent: a second pass changes nothing.
        document(&mut d, &layer, |_, _| true);
        assert_eq!(json(&d), once);
        // GET is not a protected method.
        assert!(once["paths"]["/things"]["get"]["parameters"].is_null());
    }

    #[test]
    fn a_webhook_answers_in_progress_with_its_own_status_and_no_409() {
        let layer = IdempotencyLayer::new(MemoryStore::new()).with_webhook(Webhook::new(
            Key::header(HeaderName::from_static("webhook-id")),
        ));
        let mut d = doc();
        document(&mut d, &layer, |_, _| true);
        let responses = &json(&d)["paths"]["/things"]["post"]["responses"];
        assert!(responses["409"].is_null());
        let r503 = responses["503"]["description"].as_str().unwrap();
        assert!(r503.contains("in-progress") && r503.contains("store-unavailable"));
        assert!(responses["503"]["headers"]["retry-after-ms"].is_object());
    }

    #[test]
    fn uncovered_paths_are_untouched_and_get_no_schema() {
        let layer = IdempotencyLayer::new(MemoryStore::new());
        let mut d = doc();
        let before = json(&d);
        document(&mut d, &layer, |path, _| path != "/things");
        assert_eq!(json(&d), before);
    }
}
