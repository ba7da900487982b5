//! Run with: `cargo bench --bench fingerprint`
//!
//! The canonical-JSON digest of a request body beside baselines measured in the same run:
//! SHA-256 of the raw bytes, `serde_json::from_slice::<Value>` (parsing alone) and `serde_json`
//! reading into `IgnoredAny` (validation alone).
//! Bodies of about 200 B, 1 KiB, 64 KiB and 1 MiB: orders of nested objects, escaped
//! strings, integers and decimals.
#![allow(missing_docs)]

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use sha2::{Digest, Sha256};

/// An order of `n` items: about 110 bytes per item.
fn order_json(n: usize) -> Vec<u8> {
    let items: Vec<String> = (0..n)
        .map(|i| {
            format!(
                r#"{{"sku":"SKU-{i:05}","name":"Item number {i} \u00e9\u00e8 \"quoted\"","qty":{},"unit_price":{}.{:02},"tags":["a","b","c"],"attrs":{{"z":{i},"a":true,"m":null}}}}"#,
                i % 7 + 1,
                i * 3 % 1000,
                i % 100
            )
        })
        .collect();
    format!(
        r#"{{"customer":"cus_123","currency":"EUR","items":[{}],"note":"deliver after 5pm"}}"#,
        items.join(",")
    )
    .into_bytes()
}

/// `FINGERPRINT_COUNT=<items> <bench binary>`: canonicalise and hash that order 100 times
/// (`FINGERPRINT_ROUNDS` to change) and exit, without criterion: a fixed workload for `valgrind --tool=callgrind`, whose instruction
/// counts do not move with the machine's load (see BENCHMARKS.md).
fn count_only() -> bool {
    let Some(items) = std::env::var("FINGERPRINT_COUNT")
        .ok()
        .and_then(|v| v.parse().ok())
    else {
        return false;
    };
    // `FINGERPRINT_FILE=<path>` times that body instead (the item count is then unused).
    let body = match std::env::var_os("FINGERPRINT_FILE") {
        Some(path) => std::fs::read(path).expect("FINGERPRINT_FILE is readable"),
        None => order_json(items),
    };
    let rounds = std::env::var("FINGERPRINT_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100);
    // `FINGERPRINT_CASE=sha256_raw`, `sha256_canonical`, `canonical_json`,
    // `serde_json_value`, `serde_json_ignored` or `simd_json_tape` runs a baseline the same
    // way, so that CPU times (`perf stat -e task-clock`) compare when wall-clock figures are
    // too noisy.
    match std::env::var("FINGERPRINT_CASE").as_deref() {
        Ok("sha256_raw") => (0..rounds).for_each(|_| {
            black_box(Sha256::digest(black_box(&body)));
        }),
        // SHA-256 of the canonical bytes alone: subtracted from the fingerprint's time, the
        // canonicaliser's own.
        Ok("sha256_canonical") => {
            let canonical = tower_idempotency::__bench::canonical_json(&body).unwrap();
            (0..rounds).for_each(|_| {
                black_box(Sha256::digest(black_box(&canonical)));
            })
        }
        // The canonicaliser alone, measured directly: it also allocates its output each round.
        Ok("canonical_json") => (0..rounds).for_each(|_| {
            black_box(tower_idempotency::__bench::canonical_json(black_box(&body)).unwrap());
        }),
        Ok("serde_json_value") => (0..rounds).for_each(|_| {
            black_box(serde_json::from_slice::<serde_json::Value>(black_box(&body)).unwrap());
        }),
        // Validation alone: serde_json reading the body and keeping nothing.
        Ok("serde_json_ignored") => (0..rounds).for_each(|_| {
            serde_json::from_slice::<serde::de::IgnoredAny>(black_box(&body)).unwrap();
        }),
        // A SIMD parser's tape (simd-json: structure found 32-64 bytes a step, strings
        // unescaped): what fast parsing alone costs, beside SHA-256. It parses in place, so
        // each round first copies the body, and that copy counts in its time.
        Ok("simd_json_tape") => {
            let mut buf = body.clone();
            let mut buffers = simd_json::Buffers::default();
            (0..rounds).for_each(|_| {
                buf.copy_from_slice(&body);
                black_box(
                    simd_json::to_tape_with_buffers(black_box(&mut buf), &mut buffers).unwrap(),
                );
            })
        }
        _ => (0..rounds).for_each(|_| {
            assert!(tower_idempotency::__bench::canonical_json_digest(black_box(&body)).is_some());
        }),
    }
    true
}

fn fingerprint(c: &mut Criterion) {
    if count_only() {
        return;
    }
    // Item counts for bodies of about 200 B, 1 KiB, 64 KiB and 1 MiB.
    for (label, items) in [("200B", 1), ("1KiB", 6), ("64KiB", 400), ("1MiB", 6400)] {
        let body = order_json(items);
        assert!(tower_idempotency::__bench::canonical_json_digest(&body).is_some());
        let mut g = c.benchmark_group(format!("fingerprint/{label}"));
        g.throughput(Throughput::Bytes(body.len() as u64));
        g.warm_up_time(Duration::from_millis(500));
        g.measurement_time(Duration::from_secs(2));
        g.bench_with_input(
            BenchmarkId::new("sha256_raw", body.len()),
            &body,
            |b, body| b.iter(|| Sha256::digest(black_box(body))),
        );
        g.bench_with_input(
            BenchmarkId::new("serde_json_value", body.len()),
            &body,
            |b, body| {
                b.iter(|| serde_json::from_slice::<serde_json::Value>(black_box(body)).unwrap())
            },
        );
        g.bench_with_input(
            BenchmarkId::new("serde_json_ignored", body.len()),
            &body,
            |b, body| {
                b.iter(|| serde_json::from_slice::<serde::de::IgnoredAny>(black_box(body)).unwrap())
            },
        );
        g.bench_with_input(
            BenchmarkId::new("canonical_json_sha256", body.len()),
            &body,
            |b, body| b.iter(|| tower_idempotency::__bench::canonical_json_digest(black_box(body))),
        );
        g.finish();
    }
}

criterion_group!(benches, fingerprint);
criterion_main!(benches);
