//! The code generated from `examples/proto/shop.proto` is committed, so that nobody who builds
//! the crate or its examples compiles protobuf tooling. This test keeps it honest. It is its
//! own test target so that it can regenerate the file even when the example no longer
//! compiles against the stale copy.

use std::path::Path;

/// Regenerates `examples/grpc/generated` into a temp dir with protox and tonic-prost-build
/// and compares it with the committed copy. `UPDATE_GENERATED=1` rewrites the committed copy.
#[test]
fn committed_generated_code_matches_the_proto() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let fds = protox::compile(["shop.proto"], [root.join("examples/proto")]).unwrap();
    let out =
        std::env::temp_dir().join(format!("tower-idempotency-codegen-{}", std::process::id()));
    std::fs::create_dir_all(&out).unwrap();
    tonic_prost_build::configure()
        .out_dir(&out)
        .compile_fds(fds)
        .unwrap();
    let fresh = std::fs::read_to_string(out.join("shop.v1.rs")).unwrap();
    std::fs::remove_dir_all(&out).unwrap();
    let committed_path = root.join("examples/grpc/generated/shop.v1.rs");
    if std::env::var("UPDATE_GENERATED").as_deref() == Ok("1") {
        std::fs::write(&committed_path, &fresh).unwrap();
    }
    let committed = std::fs::read_to_string(&committed_path).unwrap_or_default();
    assert!(
        committed == fresh,
        "examples/grpc/generated/shop.v1.rs is stale: run \
         `UPDATE_GENERATED=1 cargo test --test grpc_codegen`"
    );
}
