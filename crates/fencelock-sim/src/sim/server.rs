//! The server node: the real core applied the way the engine applies it, a
//! simulated disk (synced vs not), group commit, crash and recovery.

use fencelock_core::{
    Acquire, Command, Config, Core, Outcome, OwnerToken, PlantedBugs, Reply, SessionId, WaitEnd,
};

use super::{failure_of, grid, Answer, Ev, Failure, Record, Request, Sim, GRID_MS};
use crate::PlantedBug;

impl Sim {
    fn service_now(&self) -> u64 {
        self.server.base_ms + (self.now - self.server.started_at)
    }

    fn wall_now(&self) -> i64 {
        self.now as i64 + self.server.wall_offset_ms
    }

    /// Applies a command the way the engine does: at the service time, logged if it
    /// changed state, its outcomes routed, its replies held until the next sync.
    pub(super) fn server_apply(
        &mut self,
        command: Command,
    ) -> Result<Reply, fencelock_core::Error> {
        let now = self.service_now();
        let wall_ms = self.wall_now();
        let core = self.server.core.as_mut().expect("server is up");
        let due = core.next_deadline_ms().is_some_and(|d| d <= now);
        let is_tick = matches!(command, Command::Tick);
        let result = core.apply(now, command.clone());
        let outcomes = core.take_outcomes();
        self.stats.commands += 1;
        let record = self.server.appended;
        self.checker
            .on_apply(now, record, &command, &result, &outcomes);
        if due || (result.is_ok() && !is_tick) {
            self.server.unsynced.push(Record {
                now_ms: now,
                wall_ms,
                command: command.clone(),
            });
            self.server.appended += 1;
        }
        self.mix(now);
        self.mix(match &result {
            Ok(Reply::Granted(g)) => 1 << 32 | g.fence.get(),
            Ok(Reply::Queued { position, .. }) => 2 << 32 | *position as u64,
            Ok(_) => 3,
            Err(e) => 4 << 32 | e.kind().code().len() as u64,
        });
        let shown = self.options.trace.then(|| format!("{result:?}"));
        self.trace(|| {
            format!(
                "server applied at service {now}: {command:?} → {}",
                shown.unwrap_or_default()
            )
        });
        for outcome in outcomes {
            match outcome {
                // A multi-lock request's client listens on its first part's token.
                Outcome::GrantedAll(grants) => {
                    for g in &grants {
                        self.mix(5 << 32 | g.fence.get());
                    }
                    let first = grants.first().map(|g| g.token);
                    let listeners = first
                        .and_then(|t| self.server.listeners.remove(&t))
                        .unwrap_or_default();
                    for (client, rpc) in listeners {
                        let answer = Answer::GrantedAll {
                            grants: grants.iter().map(|g| (g.fence.get(), g.token)).collect(),
                            ttl_ms: grants.first().map_or(0, |g| g.ttl_ms),
                        };
                        self.server
                            .pending
                            .push((client, rpc, answer, grants.clone()));
                    }
                }
                Outcome::Granted(grant) => {
                    self.mix(5 << 32 | grant.fence.get());
                    for (client, rpc) in self
                        .server
                        .listeners
                        .remove(&grant.token)
                        .unwrap_or_default()
                    {
                        let answer = Answer::Granted {
                            fence: grant.fence.get(),
                            token: grant.token,
                            ttl_ms: grant.ttl_ms,
                        };
                        self.server
                            .pending
                            .push((client, rpc, answer, vec![grant.clone()]));
                    }
                }
                Outcome::WaitEnded { token, reason, .. } => {
                    let failure = match reason {
                        WaitEnd::TimedOut => Failure::Timeout,
                        _ => Failure::Unavailable,
                    };
                    for (client, rpc) in self.server.listeners.remove(&token).unwrap_or_default() {
                        self.server.pending.push((
                            client,
                            rpc,
                            Answer::Failed(failure),
                            Vec::new(),
                        ));
                    }
                }
                Outcome::Event(_) => {}
            }
        }
        self.schedule_sync();
        self.schedule_tick();
        result
    }

    fn schedule_sync(&mut self) {
        let s = &self.server;
        if s.sync_at.is_none() && (!s.unsynced.is_empty() || !s.pending.is_empty()) {
            // fsync latency varies: the longer it takes, the more commands share it.
            let at = self.now + grid(self.net.range(GRID_MS, 8 * GRID_MS));
            self.server.sync_at = Some(at);
            let epoch = self.server.epoch;
            self.schedule(at, Ev::ServerSync { epoch });
        }
    }

    fn schedule_tick(&mut self) {
        if self.options.planted == Some(PlantedBug::NoExpiryTimer) {
            return;
        }
        let Some(deadline) = self.server.core.as_ref().and_then(|c| c.next_deadline_ms()) else {
            return;
        };
        let at = self.server.started_at + deadline.saturating_sub(self.server.base_ms);
        let at = at.max(self.now);
        if self.server.tick_at.is_none_or(|t| at < t) {
            self.server.tick_at = Some(at);
            let epoch = self.server.epoch;
            self.schedule(at, Ev::ServerTick { epoch });
        }
    }

    /// Group commit: everything appended so far becomes durable at once, then the
    /// replies that waited for it go out.
    pub(super) fn sync(&mut self) {
        let records = std::mem::take(&mut self.server.unsynced);
        self.server.synced.extend(records);
        for (client, rpc, answer, grants) in std::mem::take(&mut self.server.pending) {
            for grant in &grants {
                self.checker.on_ack(grant);
            }
            self.send(Ev::ToClient {
                to: client,
                rpc,
                answer,
            });
        }
        self.checker.on_sync();
        // At a sync point the live state is exactly the durable state: snapshot it
        // now and then, as the engine's replica does, and drop the log it covers.
        if self.server.synced.len() >= self.server.snapshot_every {
            let core = self.server.core.as_ref().expect("up");
            self.server.snapshot = Some(core.export());
            self.server.synced.clear();
        }
    }

    pub(super) fn server_request(&mut self, from: usize, rpc: u64, request: Request) {
        match request {
            Request::Acquire {
                name,
                ttl_ms,
                wait_ms,
                request_id,
                limit,
                lock_delay_ms,
                session,
                mode,
                value,
            } => {
                let token = OwnerToken::from_u128(
                    u128::from(self.server.rng.next_u64()) << 64
                        | u128::from(self.server.rng.next_u64()),
                );
                let owner = self.clients[from].owner.clone();
                let result = self.server_apply(Command::Acquire(Acquire {
                    name,
                    token,
                    ttl_ms: session.is_none().then_some(ttl_ms),
                    wait_ms,
                    owner,
                    request_id: Some(request_id),
                    limit,
                    lock_delay_ms,
                    session,
                    // One principal for every client: its usage counts are kept
                    // (and checked) without a quota changing what the sim expects.
                    tenant: Some(sim_tenant()),
                    quota: None,
                    mode,
                    value,
                }));
                match result {
                    Ok(Reply::Granted(grant)) => {
                        let answer = Answer::Granted {
                            fence: grant.fence.get(),
                            token: grant.token,
                            ttl_ms: grant.ttl_ms,
                        };
                        self.server.pending.push((from, rpc, answer, vec![grant]));
                    }
                    Ok(Reply::Queued { token, .. }) => {
                        self.server
                            .listeners
                            .entry(token)
                            .or_default()
                            .push((from, rpc));
                    }
                    Ok(other) => unreachable!("acquire replied {other:?}"),
                    Err(e) => {
                        let failure = failure_of(e.kind());
                        self.server
                            .pending
                            .push((from, rpc, Answer::Failed(failure), Vec::new()));
                    }
                }
            }
            Request::AcquireAll {
                parts,
                ttl_ms,
                wait_ms,
                request_id,
            } => {
                let owner = self.clients[from].owner.clone();
                let parts: Vec<Acquire> = parts
                    .into_iter()
                    .map(|(name, limit, mode)| Acquire {
                        name,
                        token: OwnerToken::from_u128(
                            u128::from(self.server.rng.next_u64()) << 64
                                | u128::from(self.server.rng.next_u64()),
                        ),
                        ttl_ms: Some(ttl_ms),
                        wait_ms,
                        owner: owner.clone(),
                        request_id: Some(request_id.clone()),
                        limit,
                        lock_delay_ms: 0,
                        session: None,
                        tenant: Some(sim_tenant()),
                        quota: None,
                        mode,
                        value: None,
                    })
                    .collect();
                match self.server_apply(Command::AcquireAll(parts)) {
                    Ok(Reply::GrantedAll(grants)) => {
                        let answer = Answer::GrantedAll {
                            grants: grants.iter().map(|g| (g.fence.get(), g.token)).collect(),
                            ttl_ms: grants.first().map_or(ttl_ms, |g| g.ttl_ms),
                        };
                        self.server.pending.push((from, rpc, answer, grants));
                    }
                    Ok(Reply::QueuedAll { tokens }) => {
                        if let Some(first) = tokens.first() {
                            self.server
                                .listeners
                                .entry(*first)
                                .or_default()
                                .push((from, rpc));
                        }
                    }
                    Ok(other) => unreachable!("multi-lock acquire replied {other:?}"),
                    Err(e) => {
                        let answer = Answer::Failed(failure_of(e.kind()));
                        self.server.pending.push((from, rpc, answer, Vec::new()));
                    }
                }
            }
            Request::ReleaseAll { grants } => {
                let answer = match self.server_apply(Command::ReleaseAll { grants }) {
                    Ok(_) => Answer::Released,
                    Err(e) => Answer::Failed(failure_of(e.kind())),
                };
                self.server.pending.push((from, rpc, answer, Vec::new()));
            }
            Request::Proclaim { name, token, value } => {
                let answer = match self.server_apply(Command::Proclaim { name, token, value }) {
                    Ok(_) => Answer::Proclaimed,
                    Err(e) => Answer::Failed(failure_of(e.kind())),
                };
                self.server.pending.push((from, rpc, answer, Vec::new()));
            }
            Request::Leader { name } => {
                // A read: answered from the live state once what it shows is
                // durable (it waits for the next sync like every reply).
                let core = self.server.core.as_ref().expect("server is up");
                let leader = core
                    .lock(&name)
                    .and_then(|v| v.holders.into_iter().find(|h| h.value.is_some()));
                let answer = Answer::Leader {
                    term: leader.as_ref().map(|h| h.fence.get()),
                    value: leader.and_then(|h| h.value),
                };
                self.server.pending.push((from, rpc, answer, Vec::new()));
            }
            Request::Renew {
                name,
                token,
                ttl_ms,
            } => {
                let answer = match self.server_apply(Command::Renew {
                    name,
                    token,
                    ttl_ms: Some(ttl_ms),
                }) {
                    Ok(Reply::Renewed(grant)) => Answer::Renewed {
                        ttl_ms: grant.ttl_ms,
                    },
                    Ok(other) => unreachable!("renew replied {other:?}"),
                    Err(e) => Answer::Failed(failure_of(e.kind())),
                };
                self.server.pending.push((from, rpc, answer, Vec::new()));
            }
            Request::Downgrade { name, token } => {
                let answer = match self.server_apply(Command::Downgrade { name, token }) {
                    Ok(_) => Answer::Downgraded,
                    Err(e) => Answer::Failed(failure_of(e.kind())),
                };
                self.server.pending.push((from, rpc, answer, Vec::new()));
            }
            Request::Release { name, token } => {
                let answer = match self.server_apply(Command::Release { name, token }) {
                    Ok(_) => Answer::Released,
                    Err(e) => Answer::Failed(failure_of(e.kind())),
                };
                self.server.pending.push((from, rpc, answer, Vec::new()));
            }
            Request::OpenSession { ttl_ms } => {
                let id = SessionId::from_u128(
                    u128::from(self.server.rng.next_u64()) << 64
                        | u128::from(self.server.rng.next_u64()),
                );
                let owner = self.clients[from].owner.clone();
                let open = Command::OpenSession {
                    id,
                    ttl_ms,
                    owner,
                    tenant: Some(sim_tenant()),
                    quota: None,
                };
                let answer = match self.server_apply(open) {
                    Ok(_) => Answer::SessionOpened { id, ttl_ms },
                    Err(e) => Answer::Failed(failure_of(e.kind())),
                };
                self.server.pending.push((from, rpc, answer, Vec::new()));
            }
            Request::KeepAlive { id } => {
                let answer = match self.server_apply(Command::KeepAlive { id }) {
                    Ok(Reply::KeptAlive { ttl_ms }) => Answer::KeptAlive { ttl_ms },
                    Ok(other) => unreachable!("keep-alive replied {other:?}"),
                    Err(e) => Answer::Failed(failure_of(e.kind())),
                };
                self.server.pending.push((from, rpc, answer, Vec::new()));
            }
            Request::CloseSession { id } => {
                let answer = match self.server_apply(Command::CloseSession { id }) {
                    Ok(_) => Answer::SessionClosed,
                    Err(e) => Answer::Failed(failure_of(e.kind())),
                };
                self.server.pending.push((from, rpc, answer, Vec::new()));
            }
        }
        self.schedule_sync();
    }

    pub(super) fn crash_server(&mut self) {
        if self.server.core.is_none() {
            return;
        }
        self.stats.faults.crash += 1;
        // Power loss keeps nothing that was not synced; a killed process leaves what
        // it had already written (a prefix of the unsynced log) in the page cache.
        let unsynced = self.server.unsynced.len();
        let kept = if self.faults.chance(500) {
            0
        } else {
            self.faults.range(0, unsynced as u64) as usize
        };
        if kept > 0 {
            self.stats.faults.crash_kept_unsynced += 1;
        }
        self.trace(|| {
            format!("CRASH: {kept} of {unsynced} unsynced records survive; waiting replies lost")
        });
        let kept_below = self.server.appended - (unsynced - kept) as u64;
        let s = &mut self.server;
        let survivors: Vec<Record> = s.unsynced.drain(..kept).collect();
        s.synced.extend(survivors);
        s.core = None;
        s.epoch += 1;
        s.unsynced.clear();
        s.pending.clear();
        s.listeners.clear();
        s.sync_at = None;
        s.tick_at = None;
        self.checker.on_crash(kept_below);
        let down = grid(self.faults.range(10, 400));
        self.schedule(self.now + down, Ev::ServerRestart);
    }

    fn core_config() -> Config {
        Config {
            max_recent_ends: 4_096,
            ..Config::default()
        }
    }

    fn planted_core_bugs(&self) -> PlantedBugs {
        PlantedBugs {
            release_by_name_only: self.options.planted == Some(PlantedBug::ReleaseByNameOnly),
            grant_expired_waiters: self.options.planted == Some(PlantedBug::GrantExpiredWaiters),
            reader_jumps_writer: self.options.planted == Some(PlantedBug::ReaderJumpsWriter),
            partial_multi_grant: self.options.planted == Some(PlantedBug::PartialMultiGrant),
            reuse_term: self.options.planted == Some(PlantedBug::ReuseTerm),
            // For these two the simulation's checker must catch the bug by itself,
            // not the core's own after-command check.
            no_check_after_command: matches!(
                self.options.planted,
                Some(PlantedBug::PartialMultiGrant | PlantedBug::ReuseTerm)
            ),
            ..PlantedBugs::default()
        }
    }

    /// Recovery as the engine does it: import the snapshot, replay the synced log
    /// (outcomes were delivered before the crash), continue the service clock from
    /// the last logged time, and log + sync a `Recover` before serving.
    pub(super) fn restart_server(&mut self) {
        let config = Sim::core_config();
        let mut core = match &self.server.snapshot {
            Some(image) => {
                self.stats.snapshot_restarts += 1;
                Core::import(config.clone(), image.clone())
                    .unwrap_or_else(|e| panic!("snapshot refused on recovery: {e}"))
            }
            None => Core::new(config.clone()),
        };
        // The same code replays the log as ran it (a planted bug included).
        core.plant_bugs(self.planted_core_bugs());
        for record in &self.server.synced {
            let _ = core.apply(record.now_ms.max(core.now_ms()), record.command.clone());
            core.take_outcomes();
        }
        if self.options.planted == Some(PlantedBug::FenceCounterNotDurable) {
            // Planted bug 2: the fence counter is not recovered; it restarts just
            // above the fences still held.
            let mut image = core.export();
            image.next_fence = image
                .locks
                .iter()
                .flat_map(|l| l.holders.iter().map(|h| h.fence.get() + 1))
                .max()
                .unwrap_or(1);
            core = Core::import(config, image).expect("a consistent image");
        }
        core.plant_bugs(self.planted_core_bugs());
        self.checker.on_replayed(&core);
        let base_ms = if self.server.epoch == 0 && self.server.synced.is_empty() {
            0
        } else {
            core.now_ms() + 1
        };
        self.server.base_ms = base_ms;
        self.server.paused_until = 0;
        self.server.started_at = self.now;
        self.server.core = Some(core);
        self.trace(|| format!("server up: service clock at {base_ms}"));
        if self.server.epoch > 0 {
            let result = self.server_apply(Command::Recover);
            assert!(result.is_ok(), "recover never fails");
            self.server.sync_at = None;
            self.sync();
            let core = self.server.core.as_ref().expect("up");
            self.checker.on_recovered(core);
        }
    }
}

/// The principal every simulated client acts as.
fn sim_tenant() -> fencelock_core::Tenant {
    fencelock_core::Tenant::new("sim").expect("a valid principal name")
}
