//! The dead-leader watchdog: a follower whose leader has gone silent asks the
//! leader's machine, with a plain TCP connect to its peer port, whether the
//! leader's process is still there, and if the connection is refused (the process
//! is gone: the kernel refuses at once) starts a Pre-Vote election as soon as the
//! voters will grant one, instead of waiting Raft's random election timeout on top.
//!
//! Why it is needed: openraft 0.10 makes a follower campaign only once
//! `now > last heard + leader lease + election timeout`, with the leader lease equal
//! to the longest election timeout, while a voter grants a (pre-)vote as soon as
//! its own lease has run out (`now > last heard + leader lease`). So after a
//! `kill -9` of the leader nobody campaigns for a random 0.5–1 election timeouts
//! during which every voter would already grant. The watchdog campaigns in that gap.
//!
//! What keeps it safe: it only calls openraft's `trigger().elect(true)`, a Pre-Vote
//! round, which openraft refuses locally while this member's own leader lease is
//! valid, and which every voter refuses while its lease is valid or its log is
//! ahead. So the election is Raft's, a leader a quorum still hears from cannot be
//! disturbed, and nothing about leases or the TTL floor changes. A probe that times
//! out or fails otherwise (a partition, a stalled but running leader, an unknown
//! host) changes nothing: Raft's own timing applies. Followers take turns (by id
//! among the voters other than the leader, one heartbeat apart), so two survivors
//! do not split the vote by campaigning at the same instant; a follower that has
//! refused a candidate for a shorter log goes at once (under load the followers'
//! logs often differ by an entry or two, and the one behind cannot win).
//!
//! The decision is [`Watchdog`], plain data driven by [`View`]s and probe results
//! (tested alone); `run` is its driver on a member, with a [`LeaderProbe`] that a
//! real member implements with TCP ([`TcpProbe`]) and the cluster simulation with
//! its simulated network.

use std::collections::BTreeMap;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use openraft::async_runtime::WatchReceiver;
use openraft::ServerState;
use tokio::time::Instant;

use super::{LeaderContact, Member, Raft};
use crate::engine::RunState;

/// What a probe of the leader's peer port found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Probed {
    /// The connection was refused: nothing listens there, the leader's process is
    /// gone.
    Refused,
    /// The port accepted the connection: the process is there (maybe slow).
    Answered,
    /// No answer in time, or another error (a partition, an unreachable host, a
    /// name that does not resolve): nothing is known.
    Unknown,
}

/// Probes a leader's peer port.
pub trait LeaderProbe: Send + Sync + 'static {
    /// Probes member `id`, recorded as `member`. Should answer within about two
    /// heartbeats; the driver gives up after [`Timing::probe_timeout`] anyway.
    fn probe<'a>(
        &'a self,
        id: u64,
        member: &'a Member,
    ) -> Pin<Box<dyn Future<Output = Probed> + Send + 'a>>;
}

/// The real probe: a TCP connect to the leader's peer address (or where
/// `--peer-dial` says to dial it), closed at once without a byte sent. The peer
/// listener closes such a connection silently.
#[derive(Debug, Clone)]
pub struct TcpProbe {
    /// Where to dial some members instead of their recorded peer address.
    pub dial: BTreeMap<u64, SocketAddr>,
    /// How long a connect may take.
    pub timeout: Duration,
}

impl LeaderProbe for TcpProbe {
    fn probe<'a>(
        &'a self,
        id: u64,
        member: &'a Member,
    ) -> Pin<Box<dyn Future<Output = Probed> + Send + 'a>> {
        Box::pin(async move {
            let connect = async {
                match self.dial.get(&id) {
                    Some(addr) => tokio::net::TcpStream::connect(addr).await,
                    None => tokio::net::TcpStream::connect(member.peer_addr.as_str()).await,
                }
            };
            match tokio::time::timeout(self.timeout, connect).await {
                Ok(Ok(_stream)) => Probed::Answered,
                Ok(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionRefused => Probed::Refused,
                Ok(Err(_)) | Err(_) => Probed::Unknown,
            }
        })
    }
}

/// The watchdog's timings, all derived from the cluster's heartbeat and openraft's
/// settings for it (see `ClusterConfig::raft_config`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timing {
    /// The Raft heartbeat interval.
    pub heartbeat: Duration,
    /// openraft's leader lease: how long after a voter last heard its leader it
    /// refuses every (pre-)vote (openraft sets it to the longest election timeout).
    pub lease: Duration,
    /// The longest election timeout: by `last heard + lease + this`, Raft's own
    /// timer has started an election, and the watchdog has nothing left to add.
    pub election_max: Duration,
}

impl Timing {
    /// The timings of a cluster with this heartbeat and election timeout range.
    pub fn new(heartbeat: Duration, election_max: Duration) -> Timing {
        Timing {
            heartbeat,
            lease: election_max,
            election_max,
        }
    }

    /// Silence after which the leader is probed: two heartbeats (one late
    /// heartbeat is common under load; two in a row are not).
    pub fn silent_after(&self) -> Duration {
        self.heartbeat * 2
    }

    /// How long one probe may take; also how often a leader that answered (or
    /// did not answer) is probed again while it stays silent.
    pub fn probe_timeout(&self) -> Duration {
        self.heartbeat * 2
    }

    /// Waited past the lease before campaigning: this member's record of the last
    /// contact is taken after openraft handled the message, but another voter may
    /// have heard the leader a little later than this one did.
    pub fn margin(&self) -> Duration {
        (self.heartbeat / 10).max(Duration::from_millis(1))
    }

    /// How far apart the followers' turns are: one heartbeat, much longer than a
    /// Pre-Vote and vote round on a healthy network, so the first campaigner has
    /// won (and its heartbeat has reset the next one's watchdog) before the next
    /// turn comes.
    pub fn stagger(&self) -> Duration {
        self.heartbeat
    }
}

/// The member as the watchdog sees it at one moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct View {
    /// Now.
    pub now: Instant,
    /// Set while this member is a voter following an established leader other
    /// than itself (a follower with a committed vote); `None` otherwise (leader,
    /// candidate, learner, no leader known).
    pub following: Option<Following>,
    /// When this member last accepted the leader's replication ([`LeaderContact`]);
    /// `None` if never in this run.
    pub last_heard: Option<Instant>,
    /// When this member last refused a (pre-)vote because the candidate's log was
    /// behind its own ([`LeaderContact::outranked`]).
    pub outranked: Option<Instant>,
}

/// Whom this member follows, and its turn among the voters that may replace it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Following {
    /// The leader's id.
    pub leader: u64,
    /// This member's place (0-based, by id) among the voters other than the leader.
    pub turn: u32,
}

impl Following {
    /// Reads it off openraft's metrics of member `me`.
    pub fn of(m: &openraft::RaftMetrics<super::TypeConfig>, me: u64) -> Option<Following> {
        Following::from_parts(
            me,
            m.state == ServerState::Follower,
            m.current_leader,
            m.membership_config.membership().voter_ids(),
        )
    }

    /// Member `me`, a follower (`follower`) of `leader` (known only with a
    /// committed vote), among `voters`: `None` unless it follows another member
    /// and is a voter itself. Turns go by id among the voters except the leader.
    pub fn from_parts(
        me: u64,
        follower: bool,
        leader: Option<u64>,
        voters: impl IntoIterator<Item = u64>,
    ) -> Option<Following> {
        let leader = leader.filter(|l| follower && *l != me)?;
        let mut others: Vec<u64> = voters.into_iter().filter(|id| *id != leader).collect();
        others.sort_unstable();
        others.dedup();
        let turn = others.iter().position(|id| *id == me)?;
        Some(Following {
            leader,
            turn: u32::try_from(turn).ok()?,
        })
    }
}

/// What the driver does next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Nothing until then (or until something changes; asking earlier is fine).
    Wait(Instant),
    /// Probe this leader, then report with [`Watchdog::probed`].
    Probe(u64),
    /// Start a Pre-Vote election now.
    Elect,
}

/// One silence of one leader: from the last contact until the next (or until
/// another leader is followed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Silence {
    leader: u64,
    last_heard: Instant,
    probed_at: Option<Instant>,
    refused: bool,
    elected_at: Option<Instant>,
}

/// The watchdog's decisions, without I/O or clock: [`Watchdog::next`] is given the
/// [`View`] and says what to do; probe results come back through
/// [`Watchdog::probed`].
#[derive(Debug, Clone)]
pub struct Watchdog {
    timing: Timing,
    silence: Option<Silence>,
}

impl Watchdog {
    /// A watchdog with these timings.
    pub fn new(timing: Timing) -> Watchdog {
        Watchdog {
            timing,
            silence: None,
        }
    }

    /// What to do now.
    ///
    /// - Not following a leader, or never heard from it: nothing (checked again a
    ///   heartbeat later).
    /// - Heard within [`Timing::silent_after`]: wait until that much silence.
    /// - Silent, not yet known dead: probe (again every [`Timing::probe_timeout`]).
    /// - Known dead (refused): campaign once, at `last heard + lease + margin +
    ///   turn × stagger`, when every voter's lease has run out and the members
    ///   before this one had their turn; or as soon as the leases have run out if
    ///   this member has meanwhile refused a candidate whose log was behind its own
    ///   (that candidate cannot win without this member's vote).
    /// - From `last heard + lease + longest election timeout` on, Raft's own timer
    ///   has started an election: nothing more until the leader changes or speaks.
    pub fn next(&mut self, view: &View) -> Action {
        let t = self.timing;
        let idle = Action::Wait(view.now + t.heartbeat);
        let (Some(following), Some(last_heard)) = (view.following, view.last_heard) else {
            self.silence = None;
            return idle;
        };
        let same = self
            .silence
            .is_some_and(|s| s.leader == following.leader && s.last_heard == last_heard);
        if !same {
            self.silence = Some(Silence {
                leader: following.leader,
                last_heard,
                probed_at: None,
                refused: false,
                elected_at: None,
            });
        }
        let Some(silence) = self.silence.as_mut() else {
            return idle;
        };
        let silent_at = last_heard + t.silent_after();
        if view.now < silent_at {
            return Action::Wait(silent_at);
        }
        let raft_takes_over = last_heard + t.lease + t.election_max;
        if view.now >= raft_takes_over {
            return idle;
        }
        if !silence.refused {
            return match silence.probed_at {
                Some(at) if view.now < at + t.probe_timeout() => {
                    Action::Wait((at + t.probe_timeout()).min(raft_takes_over))
                }
                _ => Action::Probe(following.leader),
            };
        }
        let leases_out = last_heard + t.lease + t.margin();
        if view.now < leases_out {
            return Action::Wait(leases_out);
        }
        // A member that asked for this one's vote during this silence, and was
        // refused for a shorter log, cannot win without it: no point waiting for
        // this member's turn.
        let outranked = view.outranked.is_some_and(|at| at > last_heard);
        let my_turn = leases_out + t.stagger() * following.turn;
        if view.now < my_turn && !outranked {
            return Action::Wait(my_turn);
        }
        // Once per silence. A campaign that fails (another voter heard the leader
        // later, or has a longer log) is followed by the next member's turn, and
        // in the end by Raft's own timer; campaigning again could cut into another
        // member's election (openraft queues the trigger while it waits for a
        // vote's fdatasync, when its metrics still show the old leader).
        if silence.elected_at.is_some() {
            return idle;
        }
        silence.elected_at = Some(view.now);
        Action::Elect
    }

    /// A probe of `leader` asked for by [`Watchdog::next`] came back at `at`.
    pub fn probed(&mut self, leader: u64, at: Instant, probed: Probed) {
        if let Some(silence) = self.silence.as_mut().filter(|s| s.leader == leader) {
            silence.probed_at = Some(at);
            silence.refused = probed == Probed::Refused;
        }
    }
}

/// The watchdog of member `me` while the member runs (`state`): reads openraft's
/// metrics and `contact`, probes with `probe`, triggers Pre-Vote elections, and
/// counts them in `elections`.
pub(crate) async fn run(
    raft: Raft,
    me: u64,
    contact: Arc<LeaderContact>,
    probe: Arc<dyn LeaderProbe>,
    timing: Timing,
    elections: Arc<std::sync::atomic::AtomicU64>,
    mut state: tokio::sync::watch::Receiver<RunState>,
) {
    let mut dog = Watchdog::new(timing);
    let metrics = raft.metrics();
    loop {
        if *state.borrow() != RunState::Running {
            return;
        }
        let (following, member) = {
            let m = metrics.borrow_watched();
            if m.running_state.is_err() {
                return;
            }
            let following = Following::of(&m, me);
            let member = following.and_then(|f| {
                m.membership_config
                    .membership()
                    .get_node(&f.leader)
                    .cloned()
            });
            (following, member)
        };
        let view = View {
            now: Instant::now(),
            following,
            last_heard: contact.last(),
            outranked: contact.outranked(),
        };
        match dog.next(&view) {
            Action::Wait(at) => {
                tokio::select! {
                    () = tokio::time::sleep_until(at) => {}
                    () = contact.outranked_changed() => {}
                    changed = state.changed() => if changed.is_err() { return },
                }
            }
            Action::Probe(leader) => {
                let probed = match &member {
                    Some(member) => {
                        tokio::time::timeout(timing.probe_timeout(), probe.probe(leader, member))
                            .await
                            .unwrap_or(Probed::Unknown)
                    }
                    None => Probed::Unknown,
                };
                if probed == Probed::Refused {
                    tracing::info!(
                        leader,
                        "the silent leader's peer port refuses connections (its process is gone); campaigning once the voters' leases run out"
                    );
                }
                dog.probed(leader, Instant::now(), probed);
            }
            Action::Elect => {
                tracing::info!(
                    leader = ?following.map(|f| f.leader),
                    "the leader is gone: starting a Pre-Vote election"
                );
                elections.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if raft.trigger().elect(true).await.is_err() {
                    return; // Raft stopped
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HB: Duration = Duration::from_millis(50);

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn timing() -> Timing {
        Timing::new(HB, ms(500))
    }

    /// A watchdog whose leader (1) was last heard at `t0`; this member's turn is
    /// `turn`.
    struct Check {
        dog: Watchdog,
        t0: Instant,
        following: Option<Following>,
        last_heard: Option<Instant>,
        outranked: Option<Instant>,
    }

    impl Check {
        fn new(turn: u32) -> Check {
            let t0 = Instant::now();
            Check {
                dog: Watchdog::new(timing()),
                t0,
                following: Some(Following { leader: 1, turn }),
                last_heard: Some(t0),
                outranked: None,
            }
        }

        /// What the watchdog does `after` the last contact.
        fn at(&mut self, after: Duration) -> Action {
            self.dog.next(&View {
                now: self.t0 + after,
                following: self.following,
                last_heard: self.last_heard,
                outranked: self.outranked,
            })
        }

        fn probed(&mut self, after: Duration, probed: Probed) {
            self.dog.probed(1, self.t0 + after, probed);
        }

        fn wait(&self, after: Duration) -> Action {
            Action::Wait(self.t0 + after)
        }
    }

    #[test]
    fn a_refused_leader_is_replaced_as_soon_as_the_voters_leases_run_out() {
        let mut c = Check::new(0);
        // Heard recently: wait for two heartbeats of silence.
        assert_eq!(c.at(ms(30)), c.wait(ms(100)));
        assert_eq!(c.at(ms(100)), Action::Probe(1));
        c.probed(ms(101), Probed::Refused);
        // Lease (500) + margin (5): not a moment before every voter grants.
        assert_eq!(c.at(ms(102)), c.wait(ms(505)));
        assert_eq!(c.at(ms(504)), c.wait(ms(505)));
        assert_eq!(c.at(ms(505)), Action::Elect);
        // Once per silence: then the next member's turn, and Raft's own timer.
        assert_eq!(c.at(ms(520)), c.wait(ms(570)));
        assert_eq!(c.at(ms(605)), c.wait(ms(655)));
        assert_eq!(c.at(ms(900)), c.wait(ms(950)));
    }

    #[test]
    fn followers_take_turns_one_heartbeat_apart() {
        let mut second = Check::new(1);
        assert_eq!(second.at(ms(100)), Action::Probe(1));
        second.probed(ms(100), Probed::Refused);
        assert_eq!(second.at(ms(505)), second.wait(ms(555)));
        assert_eq!(second.at(ms(555)), Action::Elect);
    }

    #[test]
    fn a_member_that_refused_a_shorter_log_does_not_wait_its_turn() {
        let mut second = Check::new(1);
        assert_eq!(second.at(ms(100)), Action::Probe(1));
        second.probed(ms(100), Probed::Refused);
        // The first member asked at its turn (505) and was refused by log.
        second.outranked = Some(second.t0 + ms(506));
        assert_eq!(second.at(ms(506)), Action::Elect);
        // Never before the leases run out, and a refusal before this silence (to
        // a candidate of an earlier election) does not count.
        let mut early = Check::new(1);
        early.outranked = Some(early.t0 + ms(300));
        assert_eq!(early.at(ms(100)), Action::Probe(1));
        early.probed(ms(100), Probed::Refused);
        assert_eq!(early.at(ms(400)), early.wait(ms(505)));
        assert_eq!(early.at(ms(505)), Action::Elect);
        let mut stale = Check::new(1);
        stale.outranked = Some(stale.t0 - ms(1));
        assert_eq!(stale.at(ms(100)), Action::Probe(1));
        stale.probed(ms(100), Probed::Refused);
        assert_eq!(stale.at(ms(505)), stale.wait(ms(555)));
        // Nor without knowing the leader is dead.
        let mut unsure = Check::new(1);
        unsure.outranked = Some(unsure.t0 + ms(506));
        assert_eq!(unsure.at(ms(100)), Action::Probe(1));
        unsure.probed(ms(100), Probed::Unknown);
        assert_eq!(unsure.at(ms(506)), Action::Probe(1));
    }

    #[test]
    fn a_leader_that_answers_or_cannot_be_reached_is_left_to_raft() {
        for probed in [Probed::Answered, Probed::Unknown] {
            let mut c = Check::new(0);
            assert_eq!(c.at(ms(100)), Action::Probe(1));
            c.probed(ms(150), probed);
            // Probed again every probe timeout, never elected.
            assert_eq!(c.at(ms(160)), c.wait(ms(250)));
            assert_eq!(c.at(ms(505)), Action::Probe(1), "{probed:?}");
            c.probed(ms(505), probed);
            assert_eq!(c.at(ms(600)), c.wait(ms(605)), "{probed:?}");
        }
    }

    #[test]
    fn a_leader_that_dies_after_answering_is_still_noticed() {
        let mut c = Check::new(0);
        assert_eq!(c.at(ms(100)), Action::Probe(1));
        c.probed(ms(101), Probed::Answered);
        assert_eq!(c.at(ms(201)), Action::Probe(1));
        c.probed(ms(202), Probed::Refused);
        assert_eq!(c.at(ms(505)), Action::Elect);
    }

    #[test]
    fn once_raft_s_own_timer_has_fired_the_watchdog_stays_out() {
        let mut c = Check::new(0);
        // Lease 500 + longest election timeout 500: Raft has campaigned by then.
        assert_eq!(c.at(ms(1_000)), c.wait(ms(1_050)));
        let mut c = Check::new(0);
        assert_eq!(c.at(ms(100)), Action::Probe(1));
        c.probed(ms(100), Probed::Refused);
        assert_eq!(c.at(ms(1_000)), c.wait(ms(1_050)));
    }

    #[test]
    fn a_new_contact_or_a_new_leader_starts_over() {
        let mut c = Check::new(0);
        assert_eq!(c.at(ms(100)), Action::Probe(1));
        c.probed(ms(100), Probed::Refused);
        // The leader spoke after all: a fresh silence, probed afresh.
        c.last_heard = Some(c.t0 + ms(200));
        assert_eq!(c.at(ms(250)), c.wait(ms(300)));
        assert_eq!(c.at(ms(300)), Action::Probe(1));
        // Another leader now: the old one's refusal does not carry over.
        c.following = Some(Following { leader: 2, turn: 0 });
        assert_eq!(c.at(ms(300)), Action::Probe(2));
        // A late answer about the old leader changes nothing.
        c.probed(ms(301), Probed::Refused);
        assert_eq!(c.at(ms(302)), Action::Probe(2));
    }

    #[test]
    fn nothing_happens_without_a_leader_to_follow_or_a_contact() {
        let mut c = Check::new(0);
        c.following = None;
        assert_eq!(c.at(ms(600)), c.wait(ms(650)));
        let mut c = Check::new(0);
        c.last_heard = None;
        assert_eq!(c.at(ms(600)), c.wait(ms(650)));
    }

    #[test]
    fn turns_go_by_id_among_the_voters_other_than_the_leader() {
        let f = |me, follower, leader, voters: &[u64]| {
            Following::from_parts(me, follower, leader, voters.iter().copied())
        };
        assert_eq!(
            f(1, true, Some(3), &[3, 2, 1]),
            Some(Following { leader: 3, turn: 0 })
        );
        assert_eq!(
            f(2, true, Some(3), &[1, 2, 3]),
            Some(Following { leader: 3, turn: 1 })
        );
        assert_eq!(
            f(5, true, Some(1), &[1, 2, 3, 4, 5]),
            Some(Following { leader: 1, turn: 3 })
        );
        // Not following: the leader itself, a candidate, no leader, a learner.
        assert_eq!(f(3, true, Some(3), &[1, 2, 3]), None);
        assert_eq!(f(1, false, Some(3), &[1, 2, 3]), None);
        assert_eq!(f(1, true, None, &[1, 2, 3]), None);
        assert_eq!(f(4, true, Some(3), &[1, 2, 3]), None);
    }

    #[tokio::test]
    async fn the_tcp_probe_tells_a_closed_port_from_an_open_one() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let open = listener.local_addr().unwrap();
        // A port nobody listens on: bind, note, close.
        let closed = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap()
        };
        let probe = TcpProbe {
            dial: BTreeMap::from([(3, closed)]),
            timeout: Duration::from_secs(5),
        };
        let member = |addr: SocketAddr| Member {
            peer_addr: addr.to_string(),
            url: String::new(),
        };
        assert_eq!(probe.probe(1, &member(open)).await, Probed::Answered);
        assert_eq!(probe.probe(2, &member(closed)).await, Probed::Refused);
        // `--peer-dial` wins over the recorded address.
        assert_eq!(probe.probe(3, &member(open)).await, Probed::Refused);
        let unresolvable = Member {
            peer_addr: "no-such-host.invalid:1".into(),
            url: String::new(),
        };
        assert_eq!(probe.probe(4, &unresolvable).await, Probed::Unknown);
    }
}
