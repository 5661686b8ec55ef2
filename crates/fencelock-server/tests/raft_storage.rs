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

/// A committed id is written (it survives the process) but costs no fdatasync of
/// its own: syncing it put one more fdatasync in every commit round, ahead of the
/// next entry's. Fails on the old store, which synced every group.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_committed_id_is_written_without_a_sync_of_its_own() {
    use openraft::alias::LeaderIdOf;
    use openraft::storage::RaftLogStorage;
    use openraft::vote::RaftLeaderId;

    let dir = tempfile::tempdir().expect("a temporary directory");
    let path = dir.path().join("log");
    let committed = openraft::LogId::new(LeaderIdOf::<TypeConfig>::new(2, 1).to_committed(), 9);
    let mut store = LogStore::open(&path, true).expect("the log opens");
    let syncs_at_open = store.sync_histogram().count();
    store
        .save_committed(Some(committed))
        .await
        .expect("the committed id is queued");
    // Stopping drains the writer: everything queued has been handled when it returns.
    store.stop().await;
    assert_eq!(
        store.sync_histogram().count(),
        syncs_at_open,
        "a lone committed id was fdatasynced"
    );
    drop(store);

    let mut reopened = LogStore::open(&path, true).expect("the log reopens");
    assert_eq!(
        reopened.read_committed().await.expect("read committed"),
        Some(committed),
        "the committed id was not written to the file"
    );
    reopened.stop().await;
}
