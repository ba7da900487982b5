//! [`RecoveredBody`]: the response bodies a recover function may answer with.

use std::future::Future;
use std::pin::Pin;

use bytes::Bytes;
use http::HeaderMap;
use http_body::Body;
use http_body_util::{BodyExt, Full, Limited};

use super::BoxError;

/// A recover function's answer read into memory: its bytes and trailers, or `None` when the
/// body is over the limit (recorded as a tombstone, as the layer does).
pub(super) type Read = Result<Option<(Bytes, Option<HeaderMap>)>, BoxError>;

/// The body of a response a [recover function](crate::RecoveryWorker::new) returns: the
/// in-memory ones (`Bytes`, `Vec<u8>`, `String`, `&'static str`, `Full<Bytes>`), and with
/// the `axum` feature axum's `Body`, so a recover function shares the handler's steps and
/// returns what the handler returns (`IntoResponse::into_response`).
///
/// Sealed: the worker reads each kind in the way that costs least.
pub trait RecoveredBody: sealed::Sealed + Send + 'static {}

impl<T: sealed::Sealed + Send + 'static> RecoveredBody for T {}

pub(super) mod sealed {
    /// Reads the body, at most `limit` bytes.
    pub trait Sealed {
        fn read(self, limit: usize) -> super::ReadFuture;
    }
}

pub(super) type ReadFuture = Pin<Box<dyn Future<Output = Read> + Send>>;

fn ready(bytes: Bytes, limit: usize) -> ReadFuture {
    Box::pin(std::future::ready(Ok(
        (bytes.len() <= limit).then_some((bytes, None))
    )))
}

impl sealed::Sealed for Bytes {
    fn read(self, limit: usize) -> ReadFuture {
        ready(self, limit)
    }
}

impl sealed::Sealed for Vec<u8> {
    fn read(self, limit: usize) -> ReadFuture {
        ready(Bytes::from(self), limit)
    }
}

impl sealed::Sealed for String {
    fn read(self, limit: usize) -> ReadFuture {
        ready(Bytes::from(self), limit)
    }
}

impl sealed::Sealed for &'static str {
    fn read(self, limit: usize) -> ReadFuture {
        ready(Bytes::from_static(self.as_bytes()), limit)
    }
}

impl sealed::Sealed for Full<Bytes> {
    fn read(self, limit: usize) -> ReadFuture {
        streamed(self, limit)
    }
}

#[cfg(feature = "axum")]
impl sealed::Sealed for axum::body::Body {
    fn read(self, limit: usize) -> ReadFuture {
        streamed(self, limit)
    }
}

/// Collects a streaming body, stopping past `limit` bytes.
fn streamed<B>(body: B, limit: usize) -> ReadFuture
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    Box::pin(async move {
        match Limited::new(body, limit).collect().await {
            Ok(collected) => {
                let trailers = collected.trailers().cloned();
                Ok(Some((collected.to_bytes(), trailers)))
            }
            Err(e) if e.is::<http_body_util::LengthLimitError>() => Ok(None),
            Err(e) => Err(e),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::sealed::Sealed;
    use super::*;

    #[tokio::test]
    async fn every_body_reads_to_its_bytes_or_none_over_the_limit() {
        let want = Bytes::from_static(b"{\"id\":1}");
        for read in [
            Bytes::from_static(b"{\"id\":1}").read(8),
            b"{\"id\":1}".to_vec().read(8),
            String::from("{\"id\":1}").read(8),
            "{\"id\":1}".read(8),
            Full::new(Bytes::from_static(b"{\"id\":1}")).read(8),
        ] {
            assert_eq!(read.await.unwrap().map(|(b, _)| b), Some(want.clone()));
        }
        assert!(Bytes::from_static(b"123456789")
            .read(8)
            .await
            .unwrap()
            .is_none());
        let full = Full::new(Bytes::from_static(b"123456789"));
        assert!(full.read(8).await.unwrap().is_none());
    }
}
