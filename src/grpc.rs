//! [`Grpc`]: how the layer serves gRPC, set with
//! [`IdempotencyLayer::with_grpc`](crate::IdempotencyLayer::with_grpc).

use std::num::NonZeroUsize;

use crate::error::ConfigError;

/// gRPC services that never need a key, passed through by default: health checks (probes
/// send no key) and server reflection (a bidirectional stream).
const DEFAULT_PASSTHROUGH: [&str; 3] = [
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1.ServerReflection/",
    "/grpc.reflection.v1alpha.ServerReflection/",
];

/// How the layer serves gRPC: which methods it protects and how large a request it buffers.
///
/// Given to [`IdempotencyLayer::with_grpc`](crate::IdempotencyLayer::with_grpc). Requests
/// with a gRPC `Content-Type` are then handled as gRPC: errors as gRPC statuses, answers
/// recorded on `grpc-status`, only `POST` (all gRPC calls) protected.
///
/// ```
/// # use std::num::NonZeroUsize;
/// # use tower_idempotency::{store::MemoryStore, Grpc, IdempotencyLayer};
/// // A gRPC server: every method protected but health checks, reflection and a chat stream.
/// let all = Grpc::all().passthrough("/shop.v1.Chat/")?;
/// // A server with HTTP routes too: these methods are gRPC, every other path follows the
/// // HTTP rules whatever `Content-Type` a client sends.
/// let some = Grpc::methods(["/shop.v1.Payments/CreatePayment", "/shop.v1.Orders/"])?
///     .max_request_body(NonZeroUsize::new(1 << 20).unwrap());
/// let layer = IdempotencyLayer::new(MemoryStore::new()).unscoped().with_grpc(some);
/// # drop((all, layer));
/// # Ok::<_, tower_idempotency::ConfigError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use]
pub struct Grpc {
    /// `None`: every path (a gRPC server).
    methods: Option<Vec<String>>,
    passthrough: Vec<String>,
    pub(crate) max_request_body: usize,
}

impl Grpc {
    /// Every gRPC method is protected, except the passthrough list: health checks
    /// (`/grpc.health.v1.Health/`) and server reflection from the start, and whatever
    /// [`passthrough`](Self::passthrough) adds.
    ///
    /// The layer cannot tell a unary method from a streaming one on the wire, so a service
    /// with streaming methods is safest with [`methods`](Self::methods), an explicit list of
    /// the methods that change state.
    pub fn all() -> Self {
        Self {
            methods: None,
            passthrough: DEFAULT_PASSTHROUGH.map(String::from).to_vec(),
            max_request_body: 4 << 20,
        }
    }

    /// Protects only these gRPC methods; every other gRPC request passes through untouched,
    /// and a path that is neither listed nor in the passthrough list is an HTTP route,
    /// whatever `Content-Type` a client sends to it.
    ///
    /// Each entry is a method path (`/shop.v1.Payments/CreatePayment`) or, ending in `/`, a
    /// whole service (`/shop.v1.Payments/`). A path that cannot name a gRPC method or
    /// service (no leading `/`, no service part, more than one method part) is refused.
    pub fn methods<I, P>(paths: I) -> Result<Self, ConfigError>
    where
        I: IntoIterator<Item = P>,
        P: Into<String>,
    {
        let paths = paths
            .into_iter()
            .map(|p| grpc_path(p.into()))
            .collect::<Result<_, _>>()?;
        Ok(Self {
            methods: Some(paths),
            ..Self::all()
        })
    }

    /// Lets a gRPC method (`/package.Service/Method`), or a whole service (`/package.Service/`,
    /// ending in `/`), pass through unprotected: no key, no buffering, no store call.
    ///
    /// A protected gRPC request has its request stream read whole before the handler runs
    /// and its response stream read whole before the client sees it. The layer cannot see
    /// whether a method streams, so list here the bidirectional methods (they would wait
    /// forever for the request to end), long-lived server streams and reads that need no
    /// key. Health checks and server reflection are on the list from the start. The list
    /// wins over [`methods`](Self::methods).
    ///
    /// A path that cannot name a gRPC method or service is refused, as in
    /// [`methods`](Self::methods).
    pub fn passthrough(mut self, path: impl Into<String>) -> Result<Self, ConfigError> {
        self.passthrough.push(grpc_path(path.into())?);
        Ok(self)
    }

    /// The largest gRPC request buffered (default 4 MiB, tonic's default largest message);
    /// larger: `RESOURCE_EXHAUSTED`. It bounds the whole request stream, so it is also the
    /// largest client-streaming request the layer protects. HTTP requests have their own
    /// limit, [`with_max_request_body`](crate::IdempotencyLayer::with_max_request_body).
    pub fn max_request_body(mut self, limit: NonZeroUsize) -> Self {
        self.max_request_body = limit.get();
        self
    }

    /// Whether `path` is a gRPC route by configuration: any path when no method list is set
    /// (a gRPC server), else a listed method or a passthrough entry. Any other path is an
    /// HTTP route, whatever `Content-Type` a client sends to it.
    pub(crate) fn route(&self, path: &str) -> bool {
        self.methods.as_ref().is_none_or(|m| {
            m.iter()
                .chain(&self.passthrough)
                .any(|p| path_matches(p, path))
        })
    }

    /// Whether a gRPC request to `path` is protected: in `methods` (all when unset) and not
    /// in `passthrough`.
    pub(crate) fn protected(&self, path: &str) -> bool {
        let listed = self
            .methods
            .as_ref()
            .is_none_or(|m| m.iter().any(|p| path_matches(p, path)));
        listed && !self.passthrough.iter().any(|p| path_matches(p, path))
    }

    /// The configured method or service pattern `path` matched, if a list is set: a bounded
    /// metric label, where the path itself is whatever the client sent.
    #[cfg(feature = "metrics")]
    pub(crate) fn pattern(&self, path: &str) -> Option<&str> {
        self.methods
            .as_ref()?
            .iter()
            .find(|p| path_matches(p, path))
            .map(String::as_str)
    }
}

/// Checks that `path` is `/package.Service/Method` or, for a whole service,
/// `/package.Service/`: what a gRPC request's path can be.
fn grpc_path(path: String) -> Result<String, ConfigError> {
    let valid = path.strip_prefix('/').is_some_and(|rest| {
        let mut parts = rest.split('/');
        let service = parts.next().unwrap_or_default();
        let method = parts.next();
        let visible = |s: &str| s.bytes().all(|b| b.is_ascii_graphic() && b != b'/');
        !service.is_empty()
            && visible(service)
            && method.is_some_and(visible)
            && parts.next().is_none()
    });
    if valid {
        Ok(path)
    } else {
        Err(ConfigError::new(format!(
            "{path:?} is not a gRPC method path (`/package.Service/Method`) or service (`/package.Service/`)"
        )))
    }
}

/// `pattern` names one method (`/pkg.Service/Method`) or, ending in `/`, a whole service.
fn path_matches(pattern: &str, path: &str) -> bool {
    if pattern.ends_with('/') {
        path.starts_with(pattern)
    } else {
        path == pattern
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_that_cannot_be_grpc_paths_are_refused() {
        for bad in [
            "shop.v1.Payments/Create",
            "/shop.v1.Payments",
            "//Create",
            "/shop.v1.Payments/Create/extra",
            "/shop v1.Payments/Create",
            "",
        ] {
            assert!(Grpc::methods([bad]).is_err(), "{bad:?}");
            assert!(Grpc::all().passthrough(bad).is_err(), "{bad:?}");
        }
        for good in ["/shop.v1.Payments/Create", "/shop.v1.Payments/"] {
            assert!(Grpc::methods([good]).is_ok(), "{good:?}");
            assert!(Grpc::all().passthrough(good).is_ok(), "{good:?}");
        }
    }

    #[test]
    fn grpc_methods_are_all_protected_except_health_reflection_and_the_passthrough_list() {
        let c = Grpc::all();
        assert!(c.protected("/shop.v1.Payments/CreatePayment"));
        assert!(!c.protected("/grpc.health.v1.Health/Check"));
        assert!(!c.protected("/grpc.health.v1.Health/Watch"));
        assert!(!c.protected("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo"));

        let c = Grpc::all()
            .passthrough("/shop.v1.Payments/CountCharges")
            .unwrap()
            .passthrough("/shop.v1.Chat/")
            .unwrap();
        assert!(c.protected("/shop.v1.Payments/CreatePayment"));
        assert!(!c.protected("/shop.v1.Payments/CountCharges"));
        assert!(
            c.protected("/shop.v1.Payments/CountChargesAll"),
            "exact, not a prefix"
        );
        assert!(!c.protected("/shop.v1.Chat/Talk"));

        let c = Grpc::methods(["/shop.v1.Payments/", "/shop.v1.Orders/Create"])
            .unwrap()
            .passthrough("/shop.v1.Payments/CountCharges")
            .unwrap();
        assert!(c.protected("/shop.v1.Payments/CreatePayment"));
        assert!(c.protected("/shop.v1.Orders/Create"));
        assert!(!c.protected("/shop.v1.Orders/List"));
        assert!(
            !c.protected("/shop.v1.Payments/CountCharges"),
            "passthrough wins"
        );
    }
}
