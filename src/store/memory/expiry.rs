//! Expiry: the one clock sum that cannot overflow, and the sweeps that remove expired records.

use std::time::Duration;

// Under `--cfg shuttle` the locks and atomics are shuttle's, so the model checker in
// tests/model explores their interleavings.
#[cfg(shuttle)]
use shuttle::sync::atomic::Ordering;
#[cfg(not(shuttle))]
use std::sync::atomic::Ordering;
// tokio's Instant is the monotonic clock, and it follows `tokio::time::pause` in tests.
use tokio::time::Instant;

use super::{Inner, Shard};

/// The longest lease or TTL the store keeps: 100 years stands for "forever". Longer ones
/// (`Duration::MAX`) are cut to it, so an `Instant` sum can never overflow and panic.
const MAX_SPAN: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// `now + d`, with `d` capped at [`MAX_SPAN`]: never panics.
pub(super) fn after(now: Instant, d: Duration) -> Instant {
    now.checked_add(d.min(MAX_SPAN)).unwrap_or(now)
}

impl Inner {
    pub(super) fn sweep(&self, shard: &mut Shard, now: Instant) -> usize {
        shard.last_sweep = now;
        let before = shard.map.len();
        let mut freed = 0;
        let mut scoped = Vec::new();
        shard.map.retain(|_, e| {
            let keep = e.expires_at > now;
            if !keep {
                freed += e.size as usize;
                if let Some(scope) = e.scope.take() {
                    scoped.push((*scope, e.size as usize));
                }
            }
            keep
        });
        let removed = before - shard.map.len();
        self.records.fetch_sub(removed, Ordering::Relaxed);
        self.bytes.fetch_sub(freed, Ordering::Relaxed);
        if !scoped.is_empty() {
            let mut scopes = self.scopes();
            for (scope, size) in scoped {
                Self::unscope(&mut scopes, scope, size);
            }
        }
        removed
    }

    /// Sweeps every shard, one at a time, and makes `min_expiry` exact again. The caller
    /// holds `full_sweep`.
    pub(super) fn sweep_all(&self, now: Instant) -> usize {
        // Reset first: writes during the sweep lower it again, and are kept.
        self.min_expiry.store(u64::MAX, Ordering::Release);
        let mut removed = 0;
        for shard in self.shards.iter() {
            let mut shard = shard.lock().unwrap_or_else(|e| e.into_inner());
            removed += self.sweep(&mut shard, now);
            if let Some(min) = shard.map.values().map(|e| e.expires_at).min() {
                self.note_expiry(min);
            }
        }
        removed
    }

    /// Lowers `min_expiry` to `at` if it is earlier.
    pub(super) fn note_expiry(&self, at: Instant) {
        let nanos = at.saturating_duration_since(self.epoch).as_nanos();
        let nanos = u64::try_from(nanos).unwrap_or(u64::MAX);
        self.min_expiry.fetch_min(nanos, Ordering::AcqRel);
    }

    /// Whether some record may have expired by `now` (and a full sweep could free room).
    pub(super) fn may_have_expired(&self, now: Instant) -> bool {
        let nanos = now.saturating_duration_since(self.epoch).as_nanos();
        u64::try_from(nanos).unwrap_or(u64::MAX) >= self.min_expiry.load(Ordering::Acquire)
    }
}
