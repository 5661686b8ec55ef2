//! `/v1/cluster`: membership and leadership over HTTP (status for readers,
//! changes for admins whose prefixes cover every lock).

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use axum::extract::rejection::PathRejection;
use axum::extract::{Path, State};
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use openraft::async_runtime::WatchReceiver;
use openraft::error::{ClientWriteError, RaftError};
use openraft::ChangeMembers;
use serde::Deserialize;
use serde_json::json;

use super::Member;
use crate::auth::{Action, Caller};
use crate::engine::Handle;
use crate::error::{ApiError, ApiErrorKind};
use crate::http::JsonBody;
use crate::input::invalid;

/// How long `transfer-leader` waits for the new leader to take over.
const TRANSFER_WAIT: Duration = Duration::from_secs(10);

/// The cluster routes (added to the HTTP router).
pub fn routes(router: Router<Handle>) -> Router<Handle> {
    router
        .route("/v1/cluster", get(status))
        .route("/v1/cluster/members", post(add_member))
        .route("/v1/cluster/members/{id}", delete(remove_member))
        .route("/v1/cluster/transfer-leader", post(transfer_leader))
}

fn cluster_of(h: &Handle) -> Result<&std::sync::Arc<crate::engine::ClusterShared>, ApiError> {
    h.cluster().ok_or_else(|| {
        ApiError::new(
            ApiErrorKind::NotFound,
            "this server is not a cluster member (it was started without --peers)",
        )
    })
}

/// The member, for a membership or leadership change: none while it imports a
/// single server's state (a new member could lead, from an empty state, before
/// the import is applied).
fn cluster_to_change(
    h: &Handle,
) -> Result<&std::sync::Arc<crate::engine::ClusterShared>, ApiError> {
    let c = cluster_of(h)?;
    if c.importing() {
        return Err(ApiError::new(
            ApiErrorKind::Unavailable,
            "this member is importing a single server's state; change the membership once it is done",
        ));
    }
    Ok(c)
}

/// The `/v1/cluster` body as this member sees the cluster.
pub fn status_json(h: &Handle) -> Result<serde_json::Value, ApiError> {
    let c = cluster_of(h)?;
    let m = c.raft.metrics().borrow_watched().clone();
    let membership = m.membership_config.membership();
    let leader = c.leader();
    let voters: BTreeSet<u64> = membership.voter_ids().collect();
    let members: Vec<serde_json::Value> = membership
        .nodes()
        .map(|(id, node)| {
            let role = if Some(*id) == m.current_leader {
                "leader"
            } else if voters.contains(id) {
                "follower"
            } else {
                "learner"
            };
            let url = if node.url.is_empty() {
                c.directory.url(*id)
            } else {
                Some(node.url.clone())
            };
            let matched = m
                .replication
                .as_ref()
                .and_then(|r| r.get(id).cloned())
                .map(|l| l.map_or(0, |l| l.index));
            json!({
                "id": id,
                "url": url,
                "peer_addr": node.peer_addr,
                "role": role,
                "matched_index": matched,
            })
        })
        .collect();
    Ok(json!({
        "node_id": c.node_id,
        "term": m.current_term,
        "leader": leader.map(|l| json!({"id": l.id, "url": l.url})),
        "members": members,
        "importing": c.importing(),
    }))
}

async fn status(
    State(h): State<Handle>,
    Caller(caller): Caller,
) -> Result<Json<serde_json::Value>, ApiError> {
    caller.authorize(Action::Read, None)?;
    Ok(Json(status_json(&h)?))
}

fn write_error(
    c: &crate::engine::ClusterShared,
    e: RaftError<super::TypeConfig, ClientWriteError<super::TypeConfig>>,
) -> ApiError {
    match e {
        RaftError::APIError(ClientWriteError::ForwardToLeader(_)) => c.not_leader(),
        RaftError::APIError(ClientWriteError::ChangeMembershipError(e)) => ApiError::new(
            ApiErrorKind::InvalidArgument,
            format!("membership change refused: {e}"),
        ),
        other => ApiError::new(
            ApiErrorKind::Unavailable,
            format!("membership change failed: {other}"),
        ),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AddMember {
    id: u64,
    peer_addr: String,
    url: String,
}

/// `POST /v1/cluster/members`: adds a learner, waits until it caught up, then
/// makes it a voter (joint consensus).
async fn add_member(
    State(h): State<Handle>,
    Caller(caller): Caller,
    JsonBody(body): JsonBody<AddMember>,
) -> Result<Json<serde_json::Value>, ApiError> {
    caller.authorize(Action::Snapshot, None)?;
    let c = cluster_to_change(&h)?;
    if body.id == 0 {
        return Err(invalid("id", "must be at least 1"));
    }
    if body.peer_addr.parse::<std::net::SocketAddr>().is_err() {
        return Err(invalid(
            "peer_addr",
            "must be an address like 127.0.0.1:7521",
        ));
    }
    if !(body.url.starts_with("http://") || body.url.starts_with("https://"))
        || body.url.len() > 512
    {
        return Err(invalid("url", "must be an http:// or https:// URL"));
    }
    let member = Member {
        peer_addr: body.peer_addr,
        url: body.url,
    };
    c.raft
        .add_learner(body.id, member, true)
        .await
        .map_err(|e| write_error(c, e))?;
    c.raft
        .change_membership(ChangeMembers::AddVoterIds(BTreeSet::from([body.id])), false)
        .await
        .map_err(|e| write_error(c, e))?;
    tracing::info!(member = body.id, "member added");
    Ok(Json(status_json(&h)?))
}

/// `DELETE /v1/cluster/members/{id}`: removes a voter or a learner.
async fn remove_member(
    State(h): State<Handle>,
    Caller(caller): Caller,
    path: Result<Path<String>, PathRejection>,
) -> Result<Json<serde_json::Value>, ApiError> {
    caller.authorize(Action::Snapshot, None)?;
    let c = cluster_to_change(&h)?;
    let Path(raw) = path.map_err(|e| invalid("id", e.body_text()))?;
    let id: u64 = raw
        .parse()
        .map_err(|_| invalid("id", "must be a member id (a positive integer)"))?;
    let m = c.raft.metrics().borrow_watched().clone();
    let membership = m.membership_config.membership();
    if membership.get_node(&id).is_none() {
        return Err(ApiError::new(
            ApiErrorKind::NotFound,
            format!("member {id} is not in the cluster"),
        ));
    }
    let is_voter = membership.voter_ids().any(|v| v == id);
    if is_voter {
        c.raft
            .change_membership(ChangeMembers::RemoveVoters(BTreeSet::from([id])), false)
            .await
            .map_err(|e| write_error(c, e))?;
    } else {
        c.raft
            .change_membership(ChangeMembers::RemoveNodes(BTreeSet::from([id])), false)
            .await
            .map_err(|e| write_error(c, e))?;
    }
    tracing::info!(member = id, "member removed");
    Ok(Json(status_json(&h)?))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Transfer {
    id: u64,
}

/// `POST /v1/cluster/transfer-leader`: hands leadership to a voter.
async fn transfer_leader(
    State(h): State<Handle>,
    Caller(caller): Caller,
    JsonBody(body): JsonBody<Transfer>,
) -> Result<Json<serde_json::Value>, ApiError> {
    caller.authorize(Action::Snapshot, None)?;
    let c = cluster_to_change(&h)?;
    let m = c.raft.metrics().borrow_watched().clone();
    if m.current_leader != Some(c.node_id) {
        return Err(c.not_leader());
    }
    let voters: BTreeMap<u64, ()> = m
        .membership_config
        .membership()
        .voter_ids()
        .map(|id| (id, ()))
        .collect();
    if !voters.contains_key(&body.id) {
        return Err(invalid("id", format!("member {} is not a voter", body.id)));
    }
    if body.id != c.node_id {
        c.raft
            .trigger()
            .transfer_leader(body.id)
            .await
            .map_err(|e| {
                ApiError::new(ApiErrorKind::Unavailable, format!("transfer failed: {e}"))
            })?;
        let mut metrics = c.raft.metrics();
        let waited = tokio::time::timeout(TRANSFER_WAIT, async {
            loop {
                if metrics.borrow_watched().current_leader == Some(body.id) {
                    return true;
                }
                if metrics.changed().await.is_err() {
                    return false;
                }
            }
        })
        .await;
        if !matches!(waited, Ok(true)) {
            return Err(ApiError::new(
                ApiErrorKind::Unavailable,
                format!(
                    "member {} did not take over within {TRANSFER_WAIT:?}",
                    body.id
                ),
            ));
        }
    }
    Ok(Json(json!({"leader": body.id})))
}
