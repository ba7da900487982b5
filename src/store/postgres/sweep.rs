//! Deleting expired rows: [`delete_expired`](PostgresStore::delete_expired) (sweep.sql) and
//! the background sweeper.

use std::error::Error as StdError;
use std::time::Duration;

use tokio::task::JoinHandle;

use super::PostgresStore;
use crate::store::StoreError;

/// Rows per `DELETE` in `delete_expired`: short transactions and row locks.
const SWEEP_BATCH: i64 = 1000;

impl PostgresStore {
    /// Deletes expired records in batches of 1000 until none is left, and returns how many
    /// went. Never deletes an in-progress record whose lease is live, even past `expires_at`.
    ///
    /// Each batch is its own short statement; rows a claim is replacing right now are
    /// skipped, not waited for.
    pub async fn delete_expired(&self) -> Result<u64, StoreError> {
        let mut total = 0;
        loop {
            let rows = self.run(&self.sql.sweep, &[&SWEEP_BATCH], true).await?;
            total += rows.len() as u64;
            if (rows.len() as i64) < SWEEP_BATCH {
                return Ok(total);
            }
        }
    }

    /// Runs [`delete_expired`](Self::delete_expired) every `every` (at least 1 ms) on a tokio
    /// task, until the handle is dropped or aborted. Failures are logged and retried at the
    /// next tick.
    ///
    /// One sweeper per table is enough; more only repeat the work (safely).
    #[must_use = "the sweeper stops when its handle is dropped"]
    pub fn spawn_sweeper(&self, every: Duration) -> SweeperHandle {
        let store = self.clone();
        let every = every.max(Duration::from_millis(1));
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                match store.delete_expired().await {
                    Ok(0) => {}
                    Ok(n) => tracing::debug!(deleted = n, "swept expired idempotency records"),
                    Err(e) => {
                        tracing::warn!(error = &e as &dyn StdError, "idempotency sweep failed")
                    }
                }
            }
        });
        SweeperHandle { task: Some(task) }
    }
}

/// Stops the sweeper of [`PostgresStore::spawn_sweeper`] when dropped or aborted.
#[derive(Debug)]
pub struct SweeperHandle {
    /// `None` only after [`stop`](Self::stop) took it.
    task: Option<JoinHandle<()>>,
}

impl SweeperHandle {
    /// Stops the sweeper at its next await point.
    pub fn abort(&self) {
        if let Some(task) = &self.task {
            task.abort();
        }
    }

    /// Stops the sweeper and waits until its task has ended.
    pub async fn stop(mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
            // A cancelled task ends with a cancellation error: the expected end.
            let _ = task.await;
        }
    }
}

impl Drop for SweeperHandle {
    fn drop(&mut self) {
        self.abort();
    }
}
