//! The simulated network: openraft's RPCs delivered straight to the target
//! member's `Raft`, through links the run cuts, delays and makes lossy.

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fencelock_server::cluster::watchdog::{LeaderProbe, Probed};
use fencelock_server::cluster::{LeaderContact, Member, Raft, TypeConfig, Vote};
use fencelock_sim::Rng;
use futures_util::future::BoxFuture;
use futures_util::stream::BoxStream;
use futures_util::StreamExt;
use openraft::error::{NetworkError, RPCError, ReplicationClosed, StreamingError, Unreachable};
use openraft::network::v2::RaftNetworkV2;
use openraft::network::{RPCOption, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, SnapshotResponse, StreamAppendError,
    StreamAppendResult, TransferLeaderRequest, TransferLeaderResponse, VoteRequest, VoteResponse,
};

/// What the run does to the network now.
#[derive(Debug, Default)]
struct Faults {
    /// Directed links that deliver nothing.
    cut: BTreeSet<(u64, u64)>,
    /// Messages lost, per mille.
    loss: u64,
    /// Each message waits up to this long.
    max_delay_ms: u64,
    /// Paused members (as by SIGSTOP): what they send and what is sent to them
    /// waits until they resume, then arrives (late, not lost).
    paused: BTreeMap<u64, tokio::time::Instant>,
}

/// The network every member of one run shares.
pub struct Net {
    rafts: Mutex<BTreeMap<u64, Raft>>,
    /// Each member's record of its leader's replication, as the peer listener
    /// keeps it on a real member (the dead-leader watchdog reads it).
    contacts: Mutex<BTreeMap<u64, Arc<LeaderContact>>>,
    faults: Mutex<Faults>,
    rng: Mutex<Rng>,
    /// Messages delivered and dropped, for the report.
    pub counts: Mutex<(u64, u64)>,
}

fn io(what: &str) -> std::io::Error {
    std::io::Error::other(what.to_owned())
}

impl Net {
    /// An empty network with its own random stream.
    pub fn new(rng: Rng) -> Arc<Net> {
        Arc::new(Net {
            rafts: Mutex::default(),
            contacts: Mutex::default(),
            faults: Mutex::default(),
            rng: Mutex::new(rng),
            counts: Mutex::default(),
        })
    }

    /// Member `id` is up with this `Raft`, recording its leader's replication in
    /// `contact`.
    pub fn up(&self, id: u64, raft: Raft, contact: Arc<LeaderContact>) {
        self.rafts.lock().unwrap().insert(id, raft);
        self.contacts.lock().unwrap().insert(id, contact);
    }

    /// What a TCP connect from `from` to `to`'s peer port would find now: refused
    /// when `to` is down (its process is gone), nothing when the link is cut (a
    /// partition), an answer otherwise.
    pub fn probe(&self, from: u64, to: u64) -> Probed {
        if !self.rafts.lock().unwrap().contains_key(&to) {
            Probed::Refused
        } else if self.faults.lock().unwrap().cut.contains(&(from, to)) {
            Probed::Unknown
        } else {
            Probed::Answered
        }
    }

    /// Member `id` is down: nothing reaches it.
    pub fn down(&self, id: u64) {
        self.rafts.lock().unwrap().remove(&id);
    }

    /// Cuts (or heals) both directions between `id` and every other member.
    pub fn isolate(&self, id: u64, members: &[u64], cut: bool) {
        let mut f = self.faults.lock().unwrap();
        for &other in members.iter().filter(|&&o| o != id) {
            for link in [(id, other), (other, id)] {
                if cut {
                    f.cut.insert(link);
                } else {
                    f.cut.remove(&link);
                }
            }
        }
    }

    /// Cuts one direction.
    pub fn cut(&self, from: u64, to: u64) {
        self.faults.lock().unwrap().cut.insert((from, to));
    }

    /// Loss (per mille) and delay for every message from now on.
    pub fn weather(&self, loss: u64, max_delay_ms: u64) {
        let mut f = self.faults.lock().unwrap();
        f.loss = loss;
        f.max_delay_ms = max_delay_ms;
    }

    /// Pauses member `id` until `until`.
    pub fn pause(&self, id: u64, until: tokio::time::Instant) {
        self.faults.lock().unwrap().paused.insert(id, until);
    }

    /// Heals every link and calms the weather.
    pub fn heal(&self) {
        *self.faults.lock().unwrap() = Faults::default();
    }

    /// Whether a message from `from` to `to` goes through now, and after how long.
    fn route(&self, from: u64, to: u64) -> Option<(Raft, Duration)> {
        let f = self.faults.lock().unwrap();
        let mut rng = self.rng.lock().unwrap();
        let mut counts = self.counts.lock().unwrap();
        let target = self.rafts.lock().unwrap().get(&to).cloned();
        let lost = f.cut.contains(&(from, to)) || rng.chance(f.loss);
        match target {
            Some(raft) if !lost => {
                counts.0 += 1;
                let delay = Duration::from_millis(rng.range(0, f.max_delay_ms));
                let now = tokio::time::Instant::now();
                let resume = [from, to]
                    .iter()
                    .filter_map(|id| f.paused.get(id))
                    .map(|until| until.saturating_duration_since(now))
                    .max()
                    .unwrap_or_default();
                Some((raft, delay.max(resume)))
            }
            _ => {
                counts.1 += 1;
                None
            }
        }
    }
}

/// openraft's client factory for one member.
#[derive(Clone)]
pub struct SimNetwork {
    /// The member sending.
    pub from: u64,
    /// The shared network.
    pub net: Arc<Net>,
}

impl RaftNetworkFactory<TypeConfig> for SimNetwork {
    type Network = SimPeer;

    async fn new_client(&mut self, target: u64, _node: &Member) -> SimPeer {
        SimPeer {
            from: self.from,
            to: target,
            net: self.net.clone(),
        }
    }
}

/// openraft's client for one peer.
pub struct SimPeer {
    from: u64,
    to: u64,
    net: Arc<Net>,
}

impl SimPeer {
    async fn deliver(&self) -> Result<Raft, RPCError<TypeConfig>> {
        match self.net.route(self.from, self.to) {
            Some((raft, delay)) => {
                tokio::time::sleep(delay).await;
                Ok(raft)
            }
            None => {
                // A lost message looks like a timeout to the sender.
                tokio::time::sleep(Duration::from_millis(20)).await;
                Err(RPCError::Unreachable(Unreachable::new(&io("lost"))))
            }
        }
    }

    /// The answer's way back is as unreliable as the request's. A lost answer
    /// costs the sender a timeout, as on a real network (an instant error would
    /// have openraft retry at once, and virtual time would never move).
    async fn back(&self) -> Result<(), RPCError<TypeConfig>> {
        match self.net.route(self.to, self.from) {
            Some(_) => Ok(()),
            None => {
                tokio::time::sleep(Duration::from_millis(20)).await;
                Err(RPCError::Network(NetworkError::new(&io("answer lost"))))
            }
        }
    }
}

/// One answer of a replication stream, as openraft takes it.
type StreamAnswer = Result<StreamAppendResult<TypeConfig>, RPCError<TypeConfig>>;

/// A broken stream, seen by the sender after a timeout (an instant error would
/// have openraft reopen it at once, and virtual time would never move).
async fn lost(what: &str) -> RPCError<TypeConfig> {
    tokio::time::sleep(Duration::from_millis(20)).await;
    RPCError::Network(NetworkError::new(&io(what)))
}

/// The target's Raft failed (it is shutting down): unreachable, after a timeout.
async fn remote<E: std::fmt::Display>(e: E) -> RPCError<TypeConfig> {
    tokio::time::sleep(Duration::from_millis(20)).await;
    RPCError::Unreachable(Unreachable::new(&io(&e.to_string())))
}

impl RaftNetworkV2<TypeConfig> for SimPeer {
    type SnapshotData = Vec<u8>;

    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig>,
        _option: RPCOption,
    ) -> Result<AppendEntriesResponse<TypeConfig>, RPCError<TypeConfig>> {
        let raft = self.deliver().await?;
        let answer = raft.append_entries(rpc).await;
        let answer = match answer {
            Ok(a) => a,
            Err(e) => return Err(remote(e).await),
        };
        // As the peer listener does: accepted unless refused for a higher vote.
        if !matches!(answer, AppendEntriesResponse::HigherVote(_)) {
            let contact = self.net.contacts.lock().unwrap().get(&self.to).cloned();
            if let Some(contact) = contact {
                contact.record();
            }
        }
        self.back().await?;
        Ok(answer)
    }

    /// Pipelined, as a real member's peer client is (`append_stream` in the
    /// server): one stream per replication session, whose requests and answers
    /// each travel in order, every one through the faults. A lost message breaks
    /// the stream (as a reset connection would), which the sender sees after a
    /// timeout.
    fn stream_append<'s, S>(
        &'s mut self,
        input: S,
        _option: RPCOption,
    ) -> BoxFuture<'s, Result<BoxStream<'s, StreamAnswer>, RPCError<TypeConfig>>>
    where
        S: futures_util::Stream<Item = AppendEntriesRequest<TypeConfig>> + Send + Unpin + 'static,
    {
        Box::pin(async move {
            // Opening the stream is a message like any other.
            let raft = self.deliver().await?;
            let (from, to) = (self.from, self.to);
            let broken = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let (req_tx, mut req_rx) = tokio::sync::mpsc::channel(64);
            let (net, broke) = (self.net.clone(), broken.clone());
            let sender = tokio::spawn(async move {
                let mut input = input;
                while let Some(req) = input.next().await {
                    let Some((_, delay)) = net.route(from, to) else {
                        broke.store(true, std::sync::atomic::Ordering::SeqCst);
                        return;
                    };
                    tokio::time::sleep(delay).await;
                    if req_tx.send(req).await.is_err() {
                        return;
                    }
                }
            });
            let (answer_tx, answer_rx) = tokio::sync::mpsc::channel(64);
            let net = self.net.clone();
            let contact = net.contacts.lock().unwrap().get(&to).cloned();
            tokio::spawn(async move {
                let requests = futures_util::stream::poll_fn(move |cx| req_rx.poll_recv(cx));
                let mut answers = std::pin::pin!(raft.stream_append(requests));
                while let Some(item) = answers.next().await {
                    let answer = match item {
                        Ok(result) => {
                            // As the peer listener does: accepted unless refused
                            // for a higher vote.
                            if !matches!(result, Err(StreamAppendError::HigherVote(_))) {
                                if let Some(contact) = &contact {
                                    contact.record();
                                }
                            }
                            Ok(result)
                        }
                        Err(fatal) => Err(fatal.to_string()),
                    };
                    let Some((_, delay)) = net.route(to, from) else {
                        let _ = answer_tx.send(None).await;
                        return;
                    };
                    tokio::time::sleep(delay).await;
                    if answer_tx.send(Some(answer)).await.is_err() {
                        return;
                    }
                }
            });
            struct Abort(tokio::task::JoinHandle<()>);
            impl Drop for Abort {
                fn drop(&mut self) {
                    self.0.abort();
                }
            }
            let state = (answer_rx, Abort(sender), broken, false);
            let answers =
                futures_util::stream::unfold(state, |(mut rx, sender, broken, done)| async move {
                    if done {
                        return None;
                    }
                    let item = match rx.recv().await {
                        Some(Some(Ok(result))) => {
                            return Some((Ok(result), (rx, sender, broken, false)))
                        }
                        Some(Some(Err(fatal))) => remote(fatal).await,
                        Some(None) => lost("answer lost").await,
                        None if broken.load(std::sync::atomic::Ordering::SeqCst) => {
                            lost("request lost").await
                        }
                        None => return None,
                    };
                    Some((Err(item), (rx, sender, broken, true)))
                });
            Ok(answers.boxed())
        })
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<TypeConfig>,
        _option: RPCOption,
    ) -> Result<VoteResponse<TypeConfig>, RPCError<TypeConfig>> {
        let raft = self.deliver().await?;
        let asked = rpc.last_log_id;
        let answer = raft.vote(rpc).await;
        let answer = match answer {
            Ok(a) => a,
            Err(e) => return Err(remote(e).await),
        };
        // As the peer listener does: a refusal by log wakes the watchdog.
        if let Some(contact) = self.net.contacts.lock().unwrap().get(&self.to) {
            contact.record_vote_answer(asked.as_ref(), &answer);
        }
        self.back().await?;
        Ok(answer)
    }

    async fn pre_vote(
        &mut self,
        rpc: VoteRequest<TypeConfig>,
        _option: RPCOption,
    ) -> Result<VoteResponse<TypeConfig>, RPCError<TypeConfig>> {
        let raft = self.deliver().await?;
        let asked = rpc.last_log_id;
        let answer = raft.pre_vote(rpc).await;
        let answer = match answer {
            Ok(a) => a,
            Err(e) => return Err(remote(e).await),
        };
        // As the peer listener does: a refusal by log wakes the watchdog.
        if let Some(contact) = self.net.contacts.lock().unwrap().get(&self.to) {
            contact.record_vote_answer(asked.as_ref(), &answer);
        }
        self.back().await?;
        Ok(answer)
    }

    async fn full_snapshot(
        &mut self,
        vote: Vote,
        snapshot: openraft::alias::SnapshotOf<TypeConfig, Vec<u8>>,
        cancel: impl Future<Output = ReplicationClosed> + Send + 'static,
        _option: RPCOption,
    ) -> Result<SnapshotResponse<TypeConfig>, StreamingError<TypeConfig>> {
        let send = async {
            let raft = self.deliver().await?;
            let answer = match raft.install_full_snapshot(vote, snapshot).await {
                Ok(a) => a,
                Err(e) => return Err(remote(e).await),
            };
            self.back().await?;
            Ok::<_, RPCError<TypeConfig>>(answer)
        };
        tokio::select! {
            closed = cancel => Err(StreamingError::Closed(closed)),
            result = send => result.map_err(StreamingError::from),
        }
    }

    async fn transfer_leader(
        &mut self,
        req: TransferLeaderRequest<TypeConfig>,
        _option: RPCOption,
    ) -> Result<TransferLeaderResponse<TypeConfig>, RPCError<TypeConfig>> {
        let raft = self.deliver().await?;
        let answer = raft.handle_transfer_leader(req).await;
        let answer = match answer {
            Ok(a) => a,
            Err(e) => return Err(remote(e).await),
        };
        self.back().await?;
        Ok(answer)
    }
}

/// The dead-leader watchdog's probe for one member: [`Net::probe`].
pub struct SimProbe {
    /// The member probing.
    pub from: u64,
    /// The shared network.
    pub net: Arc<Net>,
}

impl LeaderProbe for SimProbe {
    fn probe<'a>(
        &'a self,
        id: u64,
        _member: &'a Member,
    ) -> std::pin::Pin<Box<dyn Future<Output = Probed> + Send + 'a>> {
        let probed = self.net.probe(self.from, id);
        Box::pin(async move { probed })
    }
}
