//! `/v1/cluster`: membership and leadership over HTTP (status for readers,
//! changes for admins whose prefixes cover every lock).

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use axum::extract::rejection::PathRejection;
use axum::extract::{Path, State};
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use openraft::async_runtime::WatchReceiver;
use openraft::error::{ChangeMembershipError, ClientWriteError, RaftError};
use openraft::ChangeMembers;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::Member;
use crate::auth::{Action, Caller};
use crate::engine::Handle;
use crate::error::{ApiError, ApiErrorKind, CommonErrors, ErrorBody};
use crate::http::JsonBody;
use crate::input::invalid;

/// How long `transfer-leader` waits for the new leader to take over.
const TRANSFER_WAIT: Duration = Duration::from_secs(10);
/// How long one membership change (each step of an add: the learner caught up,
/// then its promotion) may take before the request is answered 503.
pub const MEMBERSHIP_WAIT: Duration = Duration::from_secs(30);

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

/// The cluster as one member sees it: what `/v1/cluster` and the dashboard's
/// "Cluster" section show.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterView {
    /// This member's id.
    pub node_id: u64,
    /// This member's role: `leader`, `follower`, `candidate`, `learner`, or
    /// `none` (not in the membership: waiting to be added, or removed).
    pub role: &'static str,
    /// The current term.
    pub term: u64,
    /// The leader as this member knows it.
    pub leader: Option<super::LeaderInfo>,
    /// On the leader: its last log index (what the members' lag counts to).
    pub last_log_index: Option<u64>,
    /// Every member of the membership, by id.
    pub members: Vec<MemberView>,
}

/// One member in a [`ClusterView`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemberView {
    /// Its id.
    pub id: u64,
    /// Its client URL, if known.
    pub url: Option<String>,
    /// Its peer address.
    pub peer_addr: String,
    /// `leader`, `follower` (a voter) or `learner`.
    pub role: &'static str,
    /// On the leader: the last log index known replicated to it (0: none yet).
    /// `None` on other members, which do not track replication.
    pub matched_index: Option<u64>,
    /// On the leader: entries it is behind, the leader's last log index − matched.
    pub lag: Option<u64>,
}

/// The cluster as member `c` sees it now.
pub fn view(c: &crate::engine::ClusterShared) -> ClusterView {
    let m = c.raft.metrics().borrow_watched().clone();
    let membership = m.membership_config.membership();
    let voters: BTreeSet<u64> = membership.voter_ids().collect();
    let leading = m.current_leader == Some(c.node_id);
    let last_log_index = leading.then(|| m.last_log_index.unwrap_or(0));
    let members = membership
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
            let matched_index = m
                .replication
                .as_ref()
                .and_then(|r| r.get(id).cloned())
                .map(|l| l.map_or(0, |l| l.index));
            let lag = matched_index
                .zip(last_log_index)
                .map(|(matched, last)| last.saturating_sub(matched));
            MemberView {
                id: *id,
                url,
                peer_addr: node.peer_addr.clone(),
                role,
                matched_index,
                lag,
            }
        })
        .collect();
    let role = if leading {
        "leader"
    } else if m.state == openraft::ServerState::Candidate {
        "candidate"
    } else if voters.contains(&c.node_id) {
        "follower"
    } else if membership.get_node(&c.node_id).is_some() {
        "learner"
    } else {
        "none"
    };
    ClusterView {
        node_id: c.node_id,
        role,
        term: m.current_term,
        leader: c.leader(),
        last_log_index,
        members,
    }
}

/// The `/v1/cluster` body.
#[derive(Debug, Serialize, ToSchema)]
#[schema(as = ClusterStatus)]
pub struct StatusJson {
    /// This member's id.
    node_id: u64,
    /// This member's role: `leader`, `follower`, `candidate`, `learner` or `none`.
    role: &'static str,
    /// The current Raft term.
    term: u64,
    /// The leader as this member knows it; `null` when it knows none.
    #[schema(required = true)]
    leader: Option<LeaderJson>,
    /// On the leader: its last log index; `null` elsewhere.
    #[schema(required = true)]
    last_log_index: Option<u64>,
    /// Every member of the membership.
    members: Vec<MemberJson>,
    /// Whether this member is importing a single server's state.
    importing: bool,
}

/// The leader in a [`StatusJson`].
#[derive(Debug, Serialize, ToSchema)]
#[schema(as = ClusterLeader)]
struct LeaderJson {
    /// Its id.
    id: u64,
    /// Its client URL.
    url: String,
}

/// One member in a [`StatusJson`].
#[derive(Debug, Serialize, ToSchema)]
#[schema(as = ClusterMember)]
struct MemberJson {
    /// Its id.
    id: u64,
    /// Its client URL, `null` if not known.
    #[schema(required = true)]
    url: Option<String>,
    /// Its peer address.
    peer_addr: String,
    /// `leader`, `follower` (a voter) or `learner`.
    role: &'static str,
    /// On the leader: the last log index known replicated to it; `null` elsewhere.
    #[schema(required = true)]
    matched_index: Option<u64>,
    /// On the leader: how many entries it is behind; `null` elsewhere.
    #[schema(required = true)]
    lag: Option<u64>,
}

/// The answer to a leadership transfer.
#[derive(Debug, Serialize, ToSchema)]
#[schema(as = ClusterTransferred)]
pub(crate) struct TransferredJson {
    /// The leader's id now.
    leader: u64,
}

/// The `/v1/cluster` body as this member sees the cluster.
pub fn status_json(h: &Handle) -> Result<StatusJson, ApiError> {
    let c = cluster_of(h)?;
    let v = view(c);
    let members = v
        .members
        .into_iter()
        .map(|m| MemberJson {
            id: m.id,
            url: m.url,
            peer_addr: m.peer_addr,
            role: m.role,
            matched_index: m.matched_index,
            lag: m.lag,
        })
        .collect();
    Ok(StatusJson {
        node_id: v.node_id,
        role: v.role,
        term: v.term,
        leader: v.leader.map(|l| LeaderJson {
            id: l.id,
            url: l.url,
        }),
        last_log_index: v.last_log_index,
        members,
        importing: c.importing(),
    })
}

/// The cluster as this member sees it (role `reader`).
#[utoipa::path(get, path = "/v1/cluster", tag = "cluster",
    responses(
        (status = 200, description = "The cluster.", body = StatusJson),
        (status = 404, description = "`not_found`: this server is not a cluster member.", body = ErrorBody),
        CommonErrors,
    ))]
pub(crate) async fn status(
    State(h): State<Handle>,
    Caller(caller): Caller,
) -> Result<Json<StatusJson>, ApiError> {
    caller.authorize(Action::Read, None)?;
    Ok(Json(status_json(&h)?))
}

type MembershipError =
    ChangeMembershipError<openraft::alias::CommittedLeaderIdOf<super::TypeConfig>, u64>;

fn write_error(
    c: &crate::engine::ClusterShared,
    e: RaftError<super::TypeConfig, ClientWriteError<super::TypeConfig>>,
) -> ApiError {
    match e {
        RaftError::APIError(ClientWriteError::ForwardToLeader(f)) => {
            // A leader whose lease ran out (no quorum heard from) forwards to
            // nobody: it must not name itself.
            let url = f.leader_id.filter(|id| *id != c.node_id).and_then(|id| {
                f.leader_node
                    .map(|n| n.url)
                    .filter(|u| !u.is_empty())
                    .or_else(|| c.directory.url(id))
            });
            ApiError::not_leader(url)
        }
        RaftError::APIError(ClientWriteError::ChangeMembershipError(e)) => {
            let kind = membership_error_kind(&e);
            let what = if kind == ApiErrorKind::Unavailable {
                "membership change not possible yet; retry shortly"
            } else {
                "membership change refused"
            };
            ApiError::new(kind, format!("{what}: {e}"))
        }
        other => ApiError::new(
            ApiErrorKind::Unavailable,
            format!("membership change failed: {other}"),
        ),
    }
}

/// How a refused membership change is answered: the transient refusals (a change
/// still in progress; a fresh leader that has not yet committed an entry of its
/// term) are 503 `unavailable`, for the caller to retry; the others (an empty
/// membership, an unknown learner, an unsupported transition, a member's address
/// changed under its id) are the request's fault, 400.
fn membership_error_kind(e: &MembershipError) -> ApiErrorKind {
    match e {
        ChangeMembershipError::InProgress(_) | ChangeMembershipError::UncommittedLeaderLog(_) => {
            ApiErrorKind::Unavailable
        }
        _ => ApiErrorKind::InvalidArgument,
    }
}

/// Runs a membership change for at most [`MEMBERSHIP_WAIT`]: a leader that lost
/// its quorum after accepting the change would otherwise hold the request forever.
async fn bounded<T>(
    c: &crate::engine::ClusterShared,
    change: impl std::future::Future<
        Output = Result<T, RaftError<super::TypeConfig, ClientWriteError<super::TypeConfig>>>,
    >,
) -> Result<T, ApiError> {
    match tokio::time::timeout(MEMBERSHIP_WAIT, change).await {
        Ok(result) => result.map_err(|e| write_error(c, e)),
        Err(_) => Err(ApiError::new(
            ApiErrorKind::Unavailable,
            format!(
                "the membership change did not complete within {} s (no quorum, or a new member still catching up); it may still take effect: check `fencelock cluster status`",
                MEMBERSHIP_WAIT.as_secs()
            ),
        )),
    }
}

/// `POST /v1/cluster/members`.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(as = AddMemberRequest)]
pub(crate) struct AddMember {
    /// The new member's id (at least 1).
    id: u64,
    /// Its peer address, `host:port`.
    peer_addr: String,
    /// Its client URL, `http://` or `https://`.
    url: String,
}

/// `POST /v1/cluster/members`: adds a learner, waits until it caught up, then
/// makes it a voter (joint consensus).
#[utoipa::path(post, path = "/v1/cluster/members", tag = "cluster",
    request_body = AddMember,
    responses(
        (status = 200, description = "Added; the cluster now.", body = StatusJson),
        (status = 404, description = "`not_found`: this server is not a cluster member.", body = ErrorBody),
        CommonErrors,
    ))]
pub(crate) async fn add_member(
    State(h): State<Handle>,
    Caller(caller): Caller,
    JsonBody(body): JsonBody<AddMember>,
) -> Result<Json<StatusJson>, ApiError> {
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
    bounded(c, c.raft.add_learner(body.id, member, true)).await?;
    bounded(
        c,
        c.raft
            .change_membership(ChangeMembers::AddVoterIds(BTreeSet::from([body.id])), false),
    )
    .await?;
    tracing::info!(member = body.id, "member added");
    Ok(Json(status_json(&h)?))
}

/// `DELETE /v1/cluster/members/{id}`: removes a voter or a learner.
#[utoipa::path(delete, path = "/v1/cluster/members/{id}", tag = "cluster",
    params(("id" = u64, Path, description = "The member's id.")),
    responses(
        (status = 200, description = "Removed; the cluster now.", body = StatusJson),
        (status = 404, description = "`not_found`: no such member, or this server is not a cluster member.", body = ErrorBody),
        CommonErrors,
    ))]
pub(crate) async fn remove_member(
    State(h): State<Handle>,
    Caller(caller): Caller,
    path: Result<Path<String>, PathRejection>,
) -> Result<Json<StatusJson>, ApiError> {
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
    let change = if is_voter {
        ChangeMembers::RemoveVoters(BTreeSet::from([id]))
    } else {
        ChangeMembers::RemoveNodes(BTreeSet::from([id]))
    };
    bounded(c, c.raft.change_membership(change, false)).await?;
    tracing::info!(member = id, "member removed");
    Ok(Json(status_json(&h)?))
}

/// `POST /v1/cluster/transfer-leader`.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(as = TransferLeaderRequest)]
pub(crate) struct Transfer {
    /// The voter to lead.
    id: u64,
}

/// `POST /v1/cluster/transfer-leader`: hands leadership to a voter.
#[utoipa::path(post, path = "/v1/cluster/transfer-leader", tag = "cluster",
    request_body = Transfer,
    responses(
        (status = 200, description = "The voter leads now.", body = TransferredJson),
        (status = 404, description = "`not_found`: this server is not a cluster member.", body = ErrorBody),
        CommonErrors,
    ))]
pub(crate) async fn transfer_leader(
    State(h): State<Handle>,
    Caller(caller): Caller,
    JsonBody(body): JsonBody<Transfer>,
) -> Result<Json<TransferredJson>, ApiError> {
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
    Ok(Json(TransferredJson { leader: body.id }))
}

#[cfg(test)]
mod tests {
    use openraft::alias::LeaderIdOf;
    use openraft::error::{EmptyMembership, InProgress, LearnerNotFound, UncommittedLeaderLog};
    use openraft::vote::RaftLeaderId;

    use super::*;
    use crate::cluster::TypeConfig;

    /// Issue 20: a fresh leader refused a membership change with 400 until it had
    /// committed an entry of its term, so a script had to tell a retryable 400 from
    /// a real one by its message. The transient refusals are 503 now.
    #[test]
    fn transient_membership_refusals_are_unavailable_and_the_rest_invalid() {
        let leader = LeaderIdOf::<TypeConfig>::new(3, 1).to_committed();
        let in_progress = MembershipError::InProgress(InProgress {
            committed: None,
            membership_log_id: Some(openraft::LogId::new(leader, 7)),
        });
        let uncommitted = MembershipError::UncommittedLeaderLog(UncommittedLeaderLog {
            committed: Some(openraft::LogId::new(leader, 6)),
            leader_log_id: openraft::LogId::new(leader, 8),
        });
        for transient in [in_progress, uncommitted] {
            assert_eq!(
                membership_error_kind(&transient),
                ApiErrorKind::Unavailable,
                "{transient}"
            );
        }
        let empty = MembershipError::EmptyMembership(EmptyMembership {});
        let unknown = MembershipError::LearnerNotFound(LearnerNotFound { node_id: 9 });
        for permanent in [empty, unknown] {
            assert_eq!(
                membership_error_kind(&permanent),
                ApiErrorKind::InvalidArgument,
                "{permanent}"
            );
        }
    }
}
