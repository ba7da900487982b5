//! How an operation's answer is stored and read back.

use bytes::Bytes;
use serde::{de::DeserializeOwned, Serialize};

/// A boxed error from a [`Codec`].
pub type CodecError = Box<dyn std::error::Error + Send + Sync>;

/// Turns an operation's answer into the bytes a record keeps, and back for every retry.
///
/// [`Json`] (serde) is the default; [`Raw`] keeps bytes as they are.
pub trait Codec<T>: Send + Sync + 'static {
    /// The media type recorded with the answer (`Content-Type` of the stored record), which
    /// an operator reading a record sees.
    fn media_type(&self) -> &'static str;
    /// The bytes to record.
    fn encode(&self, value: &T) -> Result<Bytes, CodecError>;
    /// The answer from recorded bytes.
    fn decode(&self, bytes: Bytes) -> Result<T, CodecError>;
}

/// JSON through serde: any `T: Serialize + DeserializeOwned`.
#[derive(Debug, Clone, Copy, Default)]
pub struct Json;

impl<T: Serialize + DeserializeOwned> Codec<T> for Json {
    fn media_type(&self) -> &'static str {
        "application/json"
    }

    fn encode(&self, value: &T) -> Result<Bytes, CodecError> {
        Ok(serde_json::to_vec(value)?.into())
    }

    fn decode(&self, bytes: Bytes) -> Result<T, CodecError> {
        Ok(serde_json::from_slice(&bytes)?)
    }
}

/// Bytes as they are: for an answer that is already bytes (`Bytes`, `Vec<u8>`), such as a
/// protobuf message the caller encodes itself.
#[derive(Debug, Clone, Copy, Default)]
pub struct Raw;

impl<T: AsRef<[u8]> + From<Bytes>> Codec<T> for Raw {
    fn media_type(&self) -> &'static str {
        "application/octet-stream"
    }

    fn encode(&self, value: &T) -> Result<Bytes, CodecError> {
        Ok(Bytes::copy_from_slice(value.as_ref()))
    }

    fn decode(&self, bytes: Bytes) -> Result<T, CodecError> {
        Ok(T::from(bytes))
    }
}
