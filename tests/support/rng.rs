//! A seeded SplitMix64 generator: reproducible randomness for storms and soaks, with no
//! dependency. Every run prints its seed; `IDEMPOTENCY_TEST_SEED` replays one.
#![allow(dead_code, unreachable_pub)]

#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The seed from `IDEMPOTENCY_TEST_SEED`, else one from the clock; printed either way.
    pub fn from_env(label: &str) -> Self {
        let seed = std::env::var("IDEMPOTENCY_TEST_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap()
                    .as_nanos() as u64
            });
        eprintln!("{label}: seed {seed} (IDEMPOTENCY_TEST_SEED={seed} replays it)");
        Self(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next_u64() % (hi - lo + 1)
    }
}
