//! Idempotency-Key middleware for tower.
#![cfg_attr(docsrs, feature(doc_cfg))]

mod record;
pub mod store;

pub use record::{
    Completion, DecodeError, Fingerprint, Record, RecordId, RecordState, StoredResponse, Token,
};
