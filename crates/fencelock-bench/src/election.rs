//! Election failover: candidate *processes* campaign in one election; each round the
//! leader is killed with `SIGKILL` and we time how long until the next leader's first
//! fenced write is accepted.
//!
//! A candidate is this binary re-run as `fencelock-bench candidate` ([`candidate`]):
//! it campaigns through the store's election (`fencelock::Election` over the store's
//! `LockBackend`: the fencelock server's `/v1/elections`, `fencelock-etcd`'s
//! `concurrency.Election`, `fencelock-zookeeper`'s LeaderLatch), and once it leads it
//! writes a file through a `fencelock_fence::FileGate` with its term as the fence —
//! the gate refuses a term not above the last one accepted, across processes — and
//! prints `wrote TERM` (or `refused TERM …`). The driver ([`run`]) reads the lines,
//! stamping each on arrival, and per round:
//!
//! 1. waits `settle` so the standbys are queued, then kills the leader (`SIGKILL`);
//! 2. waits for another candidate's `wrote TERM` with a term above the killed
//!    leader's: the round's time is from the kill to that line;
//! 3. starts a replacement candidate, so every kill finds the same number of them.
//!
//! Every candidate uses the same lease (`ttl`): a killed leader is noticed only when
//! its lease runs out on the store, so the figure is mostly that ttl plus how
//! promptly the store expires it and wakes the next candidate. Bounded: `rounds`
//! rounds, each given up after `round_timeout`; a candidate exits when its stdin
//! closes (the driver went away) or after [`CANDIDATE_LIFETIME`].

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::Context;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::mpsc;

use crate::read_mostly::Store;

/// The file every leader writes through the fence.
const FENCED_FILE: &str = "leader-output";

/// A candidate never lives longer than this, whatever happens to the driver.
pub const CANDIDATE_LIFETIME: Duration = Duration::from_secs(900);

/// What a candidate process needs.
#[derive(Debug, Clone)]
pub struct CandidateSpec {
    /// The store.
    pub store: Store,
    /// The election's name.
    pub election: String,
    /// This candidate's name (its value and owner).
    pub id: String,
    /// The leader's lease.
    pub ttl: Duration,
    /// The fence gate's directory (shared by all candidates).
    pub gate_dir: PathBuf,
}

/// Runs one candidate (the `candidate` subcommand): campaign, and once leading write
/// through the fence and report on stdout; then hold until killed, until leadership
/// is lost, or until stdin closes.
pub async fn candidate(spec: &CandidateSpec) -> anyhow::Result<()> {
    let gate = fencelock_fence::FileGate::new(&spec.gate_dir)?;
    let client = spec.store.client().await?;
    let election = client
        .election(spec.election.clone())
        .ttl(spec.ttl)
        .wait(Duration::from_secs(60))
        .owner(spec.id.clone());
    let give_up = Instant::now() + CANDIDATE_LIFETIME;
    let mut stdin = tokio::io::stdin();
    let mut sink = [0u8; 64];
    println!("campaigning");
    let leadership = loop {
        tokio::select! {
            campaign = election.campaign(spec.id.clone()) => match campaign {
                Ok(leadership) => break leadership,
                // Timeout (someone else led for the whole wait) or a transient error:
                // campaign again, until the lifetime ends.
                Err(e) => {
                    if Instant::now() >= give_up {
                        anyhow::bail!("no leadership within {CANDIDATE_LIFETIME:?}: {e}");
                    }
                    if e.kind() != fencelock::ErrorKind::Timeout {
                        println!("campaign-error {e}");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
            },
            read = stdin.read(&mut sink) => {
                if matches!(read, Ok(0) | Err(_)) {
                    return Ok(());
                }
            }
        }
    };
    let term = leadership.term();
    println!("leading {term}");
    let data = format!("{} {term}\n", spec.id);
    let write = tokio::task::spawn_blocking({
        let gate = gate.clone();
        move || gate.write(FENCED_FILE, term, data.as_bytes())
    })
    .await?;
    match write {
        Ok(()) => println!("wrote {term}"),
        Err(e) => println!("refused {term} {e}"),
    }
    let lost = leadership.lost();
    let stdin_closed = async { while !matches!(stdin.read(&mut sink).await, Ok(0) | Err(_)) {} };
    tokio::select! {
        reason = lost => println!("lost {reason:?}"),
        () = stdin_closed => {}
        () = tokio::time::sleep_until(give_up.into()) => {}
    }
    Ok(())
}

/// The failover rounds' shape.
#[derive(Debug, Clone)]
pub struct ElectionSpec {
    /// Candidate processes alive at each kill.
    pub candidates: usize,
    /// Kills.
    pub rounds: usize,
    /// Every candidate's lease.
    pub ttl: Duration,
    /// Before each kill: time for a new candidate to join the queue.
    pub settle: Duration,
    /// A round without a new leader's write after this is a timeout (and ends the run).
    pub round_timeout: Duration,
    /// The election's name, unique per run.
    pub election: String,
}

/// One kill.
#[derive(Debug, Clone)]
pub struct ElectionRound {
    /// The killed leader's term.
    pub old_term: u64,
    /// The new leader's term (`None`: timed out).
    pub new_term: Option<u64>,
    /// From the kill to the new leader's `leading` line.
    pub leading_after: Option<Duration>,
    /// From the kill to the new leader's first write accepted by the fence.
    pub write_after: Option<Duration>,
}

/// What the rounds measured.
#[derive(Debug, Clone, Default)]
pub struct ElectionOutcome {
    /// Every round, in order.
    pub rounds: Vec<ElectionRound>,
    /// Writes the fence refused, and terms not above the previous leader's: a correct
    /// store and gate have none.
    pub violations: u64,
    /// What the violations were (the first few).
    pub examples: Vec<String>,
    /// The fence the gate holds at the end: the last leader's term.
    pub final_fence: Option<u64>,
}

/// A line of a candidate, stamped when it arrived.
struct Line {
    candidate: usize,
    text: String,
    at: Instant,
}

struct Candidates {
    exe: PathBuf,
    store: Store,
    spec: ElectionSpec,
    gate_dir: PathBuf,
    children: Vec<Option<Child>>,
    lines: mpsc::UnboundedSender<Line>,
}

impl Candidates {
    fn spawn(&mut self) -> anyhow::Result<()> {
        let n = self.children.len();
        let (kind, endpoint) = self.store.kind_and_endpoint();
        let mut child = Command::new(&self.exe)
            .arg("candidate")
            .args(["--store", kind, "--endpoint", &endpoint])
            .args(["--election", &self.spec.election])
            .args(["--id", &format!("candidate-{n}")])
            .args(["--ttl-ms", &self.spec.ttl.as_millis().to_string()])
            .arg("--gate-dir")
            .arg(&self.gate_dir)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("start {}", self.exe.display()))?;
        let stdout = child.stdout.take().context("candidate stdout")?;
        let lines = self.lines.clone();
        tokio::spawn(async move {
            let mut reader = BufReader::new(stdout).lines();
            while let Ok(Some(text)) = reader.next_line().await {
                let line = Line {
                    candidate: n,
                    text,
                    at: Instant::now(),
                };
                if lines.send(line).is_err() {
                    break;
                }
            }
        });
        self.children.push(Some(child));
        Ok(())
    }

    async fn kill(&mut self, n: usize) -> anyhow::Result<()> {
        if let Some(mut child) = self.children.get_mut(n).and_then(Option::take) {
            child.start_kill()?;
            let _ = tokio::time::timeout(Duration::from_secs(5), child.wait()).await;
        }
        Ok(())
    }

    fn alive(&self, n: usize) -> bool {
        self.children.get(n).is_some_and(Option::is_some)
    }
}

/// Waits for a live candidate's `wrote TERM` with TERM above `above`, until
/// `deadline`; notes `leading` lines on the way, and counts `refused` lines and
/// non-increasing terms as violations. Returns (candidate, term, leading at, wrote at).
async fn next_write(
    lines: &mut mpsc::UnboundedReceiver<Line>,
    candidates: &Candidates,
    above: Option<u64>,
    deadline: Instant,
    outcome: &mut ElectionOutcome,
) -> Option<(usize, u64, Option<Instant>, Instant)> {
    let mut leading_at = None;
    loop {
        let line = tokio::time::timeout_at(deadline.into(), lines.recv())
            .await
            .ok()??;
        if !candidates.alive(line.candidate) {
            continue;
        }
        let mut words = line.text.split_whitespace();
        let (what, term) = (
            words.next(),
            words.next().and_then(|t| t.parse::<u64>().ok()),
        );
        let mut violation = |text: String| {
            outcome.violations += 1;
            if outcome.examples.len() < 10 {
                outcome.examples.push(text);
            }
        };
        match (what, term) {
            (Some("leading"), Some(_)) => leading_at = Some(line.at),
            (Some("refused"), _) => {
                violation(format!("candidate {}: {}", line.candidate, line.text))
            }
            (Some("wrote"), Some(term)) => {
                if above.is_some_and(|a| term <= a) {
                    violation(format!(
                        "candidate {} led with term {term}, not above {}",
                        line.candidate,
                        above.unwrap_or(0)
                    ));
                    continue;
                }
                return Some((line.candidate, term, leading_at, line.at));
            }
            _ => {}
        }
    }
}

/// Runs the rounds against `store`, with candidates started from `exe` (this binary).
pub async fn run(
    exe: &Path,
    store: &Store,
    spec: &ElectionSpec,
) -> anyhow::Result<ElectionOutcome> {
    anyhow::ensure!(
        spec.candidates >= 2,
        "an election failover needs two candidates"
    );
    let gate_dir = tempfile::Builder::new()
        .prefix("fencelock-bench-election-")
        .tempdir()?;
    let (sender, mut lines) = mpsc::unbounded_channel();
    let mut candidates = Candidates {
        exe: exe.to_owned(),
        store: store.clone(),
        spec: spec.clone(),
        gate_dir: gate_dir.path().to_owned(),
        children: Vec::new(),
        lines: sender,
    };
    for _ in 0..spec.candidates {
        candidates.spawn()?;
    }
    let mut outcome = ElectionOutcome::default();
    let first = next_write(
        &mut lines,
        &candidates,
        None,
        Instant::now() + spec.round_timeout,
        &mut outcome,
    )
    .await
    .context("no candidate became leader and wrote")?;
    let (mut leader, mut term) = (first.0, first.1);
    for _ in 0..spec.rounds {
        tokio::time::sleep(spec.settle).await;
        let killed_at = Instant::now();
        candidates.kill(leader).await?;
        let next = next_write(
            &mut lines,
            &candidates,
            Some(term),
            killed_at + spec.round_timeout,
            &mut outcome,
        )
        .await;
        let Some((new_leader, new_term, leading_at, wrote_at)) = next else {
            outcome.rounds.push(ElectionRound {
                old_term: term,
                new_term: None,
                leading_after: None,
                write_after: None,
            });
            break;
        };
        outcome.rounds.push(ElectionRound {
            old_term: term,
            new_term: Some(new_term),
            leading_after: leading_at.map(|at| at.saturating_duration_since(killed_at)),
            write_after: Some(wrote_at.saturating_duration_since(killed_at)),
        });
        (leader, term) = (new_leader, new_term);
        candidates.spawn()?;
    }
    let gate = fencelock_fence::FileGate::new(gate_dir.path())?;
    outcome.final_fence = gate.last_fence(FENCED_FILE)?;
    for n in 0..candidates.children.len() {
        candidates.kill(n).await?;
    }
    Ok(outcome)
}

/// The p50 and p99 of the rounds' kill → write times in ms (a timed-out round counts
/// as `timeout`), or `None` without rounds.
pub fn percentiles_ms(rounds: &[ElectionRound], timeout: Duration) -> Option<(f64, f64)> {
    let mut ms: Vec<f64> = rounds
        .iter()
        .map(|r| r.write_after.unwrap_or(timeout).as_secs_f64() * 1e3)
        .collect();
    if ms.is_empty() {
        return None;
    }
    ms.sort_by(f64::total_cmp);
    let at = |q: f64| ms[((ms.len() - 1) as f64 * q).round() as usize];
    Some((at(0.5), at(0.99)))
}
