//! Idempotency-Key middleware for tower.
#![cfg_attr(docsrs, feature(doc_cfg))]

mod body;
mod context;
mod error;
mod fingerprint;
mod key;
mod layer;
mod policy;
mod record;
mod response;
mod service;
pub mod store;

pub use body::{RequestBody, ResponseBody};
pub use context::IdempotencyContext;
pub use error::{ConfigError, ErrorKind, IdempotencyError};
pub use fingerprint::JsonPointer;
pub use layer::{IdempotencyLayer, Retention, MIN_LEASE};
pub use policy::{DefaultRecordPolicy, RecordDecision, RecordPolicy, ResponseInfo};
pub use record::{
    Completion, DecodeError, Fingerprint, Record, RecordId, RecordState, StoredResponse, Token,
};
pub use service::{Idempotency, ResponseFuture};
