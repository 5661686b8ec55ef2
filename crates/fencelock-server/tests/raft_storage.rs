//! openraft's own storage test suite against the cluster's Raft log (on
//! fencelock-log) and state machine (the engine task): log state, reads,
//! truncation, purge, votes, committed ids, membership, snapshots.

use fencelock_server::cluster::log_store::LogStore;
use fencelock_server::cluster::state_machine::StateMachine;
use fencelock_server::cluster::TypeConfig;
use openraft::testing::log::{StoreBuilder, Suite};
use openraft::StorageError;

struct Builder;

impl StoreBuilder<TypeConfig, LogStore, StateMachine, tempfile::TempDir> for Builder {
    async fn build(
        &self,
    ) -> Result<(tempfile::TempDir, LogStore, StateMachine), StorageError<TypeConfig>> {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let (log, sm) = fencelock_server::engine::storage_for_tests(dir.path())
            .await
            .expect("the storage opens");
        Ok((dir, log, sm))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openraft_storage_suite_passes() {
    Suite::test_all(Builder)
        .await
        .expect("openraft's storage suite");
}
