//! [`BufferedBody`]: the response bodies [`PostgresStore::record_in`] records as they are.

use bytes::Bytes;
use http::Response;
use http_body_util::Full;

#[cfg(doc)]
use super::PostgresStore;

/// A response body already in memory, which [`PostgresStore::record_in`] reads without
/// consuming it, so the handler records the very response it then returns: `Bytes`,
/// `Vec<u8>`, `String`, `&'static str`, `&'static [u8]` and `http_body_util::Full<Bytes>`.
///
/// A streaming body (axum's `Body`, say) cannot be read and still returned: buffer it into
/// one of these first.
///
/// Sealed: the store needs the bytes, and each implementation says how to get them cheaply.
pub trait BufferedBody: sealed::Sealed {}

impl<T: sealed::Sealed> BufferedBody for T {}

pub(super) mod sealed {
    use bytes::Bytes;
    use http::Response;

    pub trait Sealed: Sync + Sized {
        /// Calls `f` with `response` as a `Response<Bytes>`: itself when it is one, else a
        /// copy of its status and headers around its body's bytes.
        fn with_bytes<R>(response: &Response<Self>, f: impl FnOnce(&Response<Bytes>) -> R) -> R;
    }
}

/// `response`'s status, version and headers around `body` (the extensions are not
/// recorded, so they are left out).
fn rebuilt<B>(response: &Response<B>, body: Bytes) -> Response<Bytes> {
    let mut out = Response::new(body);
    *out.status_mut() = response.status();
    *out.version_mut() = response.version();
    *out.headers_mut() = response.headers().clone();
    out
}

impl sealed::Sealed for Bytes {
    fn with_bytes<R>(response: &Response<Self>, f: impl FnOnce(&Response<Bytes>) -> R) -> R {
        f(response)
    }
}

macro_rules! from_slice {
    ($($t:ty),*) => {$(
        impl sealed::Sealed for $t {
            fn with_bytes<R>(response: &Response<Self>, f: impl FnOnce(&Response<Bytes>) -> R) -> R {
                let body = Bytes::copy_from_slice(AsRef::<[u8]>::as_ref(response.body()));
                f(&rebuilt(response, body))
            }
        }
    )*};
}

from_slice!(Vec<u8>, String);

impl sealed::Sealed for &'static str {
    fn with_bytes<R>(response: &Response<Self>, f: impl FnOnce(&Response<Bytes>) -> R) -> R {
        let body: &'static str = response.body();
        f(&rebuilt(response, Bytes::from_static(body.as_bytes())))
    }
}

impl sealed::Sealed for &'static [u8] {
    fn with_bytes<R>(response: &Response<Self>, f: impl FnOnce(&Response<Bytes>) -> R) -> R {
        f(&rebuilt(response, Bytes::from_static(response.body())))
    }
}

impl sealed::Sealed for Full<Bytes> {
    fn with_bytes<R>(response: &Response<Self>, f: impl FnOnce(&Response<Bytes>) -> R) -> R {
        use futures_util::FutureExt as _;
        use http_body_util::BodyExt as _;
        // `Full` keeps its bytes private; a clone (a reference count) hands them over in its
        // one frame, ready at once.
        let collected = response.body().clone().collect().now_or_never();
        let body = match collected {
            Some(Ok(collected)) => collected.to_bytes(),
            Some(Err(never)) => match never {},
            None => unreachable!("a `Full` body is always ready"),
        };
        f(&rebuilt(response, body))
    }
}

#[cfg(test)]
mod tests {
    use super::sealed::Sealed;
    use super::*;

    fn recorded<B: Sealed>(response: &Response<B>) -> (u16, String, Bytes) {
        B::with_bytes(response, |r| {
            (
                r.status().as_u16(),
                r.headers()["content-type"].to_str().unwrap().to_owned(),
                r.body().clone(),
            )
        })
    }

    fn response<B>(body: B) -> Response<B> {
        Response::builder()
            .status(201)
            .header("content-type", "application/json")
            .body(body)
            .unwrap()
    }

    #[test]
    fn every_buffered_body_is_read_as_the_same_response() {
        let want = (
            201,
            "application/json".to_owned(),
            Bytes::from_static(b"{}"),
        );
        assert_eq!(recorded(&response(Bytes::from_static(b"{}"))), want);
        assert_eq!(recorded(&response(b"{}".to_vec())), want);
        assert_eq!(recorded(&response(String::from("{}"))), want);
        assert_eq!(recorded(&response("{}")), want);
        assert_eq!(recorded(&response(&b"{}"[..])), want);
        assert_eq!(
            recorded(&response(Full::new(Bytes::from_static(b"{}")))),
            want
        );
        // An empty `Full` has no frame at all.
        let empty = recorded(&response(Full::new(Bytes::new())));
        assert_eq!(empty.2, Bytes::new());
    }
}
