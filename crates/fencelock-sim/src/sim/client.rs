//! The clients: the client library's rules (request ids and retries, renewal every
//! third of the TTL, lost at send + ttl − margin, release with the owner token), and
//! the session API's for session clients.

use fencelock_core::{Mode, RequestId, Value};

use super::{
    grid, Acquiring, AcquiringAll, Answer, Client, Ev, Failure, Holding, HoldingAll, Part, Request,
    Role, Rpc, Session, Sim, State, MULTI_WAITS, RPC_TIMEOUT_MS,
};

impl Sim {
    pub(super) fn wake_client(&mut self, i: usize, at: u64) {
        let c = &mut self.clients[i];
        if c.wake_at.is_some_and(|w| w <= at && w >= self.now) {
            return;
        }
        c.generation += 1;
        c.wake_at = Some(at);
        let generation = c.generation;
        self.schedule(
            at,
            Ev::ClientWake {
                client: i,
                generation,
            },
        );
    }

    fn backoff(&mut self, i: usize, attempt: u32) -> u64 {
        let cap = (10u64 << attempt.min(5)).min(200);
        grid(self.clients[i].rng.range(cap / 2, cap))
    }

    fn send_request(&mut self, i: usize, request: Request, timeout_ms: u64) {
        let c = &mut self.clients[i];
        c.rpc_seq += 1;
        let rpc = c.rpc_seq;
        c.rpc = Some(Rpc {
            id: rpc,
            sent: self.now,
            timeout_at: self.now + timeout_ms,
        });
        self.stats.ops += 1;
        self.send(Ev::ToServer {
            from: i,
            rpc,
            request,
        });
    }

    fn margin(ttl_ms: u64) -> u64 {
        (ttl_ms / 10).max(1)
    }

    /// Sends an acquire (first attempt or retry with the same request id).
    fn send_acquire(&mut self, i: usize) {
        let State::Acquiring(a) = &mut self.clients[i].state else {
            return;
        };
        let sent = self.now;
        a.first_sent.get_or_insert(sent);
        let wait_ms = a.budget_end.saturating_sub(sent);
        let lock = &self.locks[a.lock];
        let session = a.session;
        let request = Request::Acquire {
            name: lock.name.clone(),
            ttl_ms: a.ttl_ms,
            wait_ms,
            request_id: a.request_id.clone(),
            limit: lock.limit,
            lock_delay_ms: a.lock_delay_ms,
            session,
            mode: a.mode,
            value: a.value.clone(),
        };
        self.send_request(i, request, wait_ms + RPC_TIMEOUT_MS);
    }

    /// Sends a multi-lock request (first attempt or retry with the same request id).
    fn send_acquire_all(&mut self, i: usize) {
        let State::AcquiringAll(a) = &mut self.clients[i].state else {
            return;
        };
        let sent = self.now;
        a.first_sent.get_or_insert(sent);
        let wait_ms = a.budget_end.saturating_sub(sent);
        let parts = a
            .parts
            .iter()
            .map(|&(lock, mode)| (self.locks[lock].name.clone(), self.locks[lock].limit, mode))
            .collect();
        let request = Request::AcquireAll {
            parts,
            ttl_ms: a.ttl_ms,
            wait_ms,
            request_id: a.request_id.clone(),
        };
        self.send_request(i, request, wait_ms + RPC_TIMEOUT_MS);
    }

    /// A multi-lock client starts a request: 1 to 3 of the plain locks in a random
    /// order, each shared or exclusive (shared only on the reader-writer lock).
    fn start_multi(&mut self, i: usize) {
        let now = self.now;
        let c = &mut self.clients[i];
        c.requests += 1;
        let request_id = RequestId::new(&format!("c{i}-{}", c.requests)).expect("valid");
        let mut order: Vec<usize> = (0..self.plain).collect();
        for k in (1..order.len()).rev() {
            let j = c.rng.index(k + 1);
            order.swap(k, j);
        }
        let n = c.rng.range(1, order.len().min(3) as u64) as usize;
        let parts = order[..n]
            .iter()
            .map(|&lock| {
                let shared = self.locks[lock].rw && c.rng.chance(500);
                (
                    lock,
                    if shared {
                        Mode::Shared
                    } else {
                        Mode::Exclusive
                    },
                )
            })
            .collect();
        let ttl_ms = self.ttls[c.rng.index(self.ttls.len())];
        let wait_ms = MULTI_WAITS[c.rng.index(MULTI_WAITS.len())];
        c.state = State::AcquiringAll(AcquiringAll {
            parts,
            ttl_ms,
            request_id,
            first_sent: None,
            budget_end: now + wait_ms,
            attempt: 0,
            retry_at: now,
        });
        self.send_acquire_all(i);
    }

    /// An elector either asks who leads, or campaigns with a value of its own.
    fn start_elector(&mut self, i: usize) {
        let now = self.now;
        let election = self.locks.len() - 1;
        let c = &mut self.clients[i];
        c.requests += 1;
        if c.rng.chance(300) {
            c.state = State::Observing {
                give_up: now + RPC_TIMEOUT_MS,
            };
            let name = self.locks[election].name.clone();
            return self.send_request(i, Request::Leader { name }, RPC_TIMEOUT_MS);
        }
        let request_id = RequestId::new(&format!("c{i}-{}", c.requests)).expect("valid");
        let value = Value::new(&format!("c{i}-{}", c.requests)).expect("valid");
        let ttl_ms = self.ttls[c.rng.index(self.ttls.len())];
        let wait_ms = self.waits[c.rng.index(self.waits.len())];
        c.state = State::Acquiring(Acquiring {
            lock: election,
            mode: Mode::Exclusive,
            lock_delay_ms: 0,
            session: None,
            ttl_ms,
            request_id,
            first_sent: None,
            budget_end: now + wait_ms,
            attempt: 0,
            retry_at: now,
            value: Some(value),
        });
        self.send_acquire(i);
    }

    /// Gives up the parts of a multi-lock grant still held, together.
    fn release_parts(&mut self, i: usize, h: &HoldingAll) {
        if h.parts.is_empty() {
            return self.go_idle(i);
        }
        let grants = h
            .parts
            .iter()
            .map(|p| (self.locks[p.lock].name.clone(), p.token))
            .collect();
        self.clients[i].state = State::Releasing {
            give_up: self.now + RPC_TIMEOUT_MS,
        };
        self.send_request(i, Request::ReleaseAll { grants }, RPC_TIMEOUT_MS);
    }

    /// Gives up a held (or possibly held) lock: a best-effort release with the owner
    /// token, as the guard does after its deadline.
    fn give_up(&mut self, i: usize, h: &Holding) {
        let name = self.locks[h.lock].name.clone();
        let margin = Sim::margin(h.ttl_ms);
        self.clients[i].state = State::Releasing {
            give_up: self.now + margin.max(RPC_TIMEOUT_MS),
        };
        self.send_request(
            i,
            Request::Release {
                name,
                token: h.token,
            },
            margin.max(RPC_TIMEOUT_MS),
        );
    }

    fn go_idle(&mut self, i: usize) {
        let think = grid(self.clients[i].rng.range(5, 150));
        self.clients[i].rpc = None;
        self.clients[i].state = State::Idle {
            next_at: self.now + think,
        };
    }

    pub(super) fn client_answer(&mut self, i: usize, rpc: u64, answer: Answer) {
        if let Some(outstanding) = self.clients[i].session_rpc.clone().filter(|r| r.id == rpc) {
            self.mix(8 << 32 | (i as u64) << 8 | rpc);
            return self.session_answer(i, outstanding, answer);
        }
        let Some(outstanding) = self.clients[i].rpc.clone().filter(|r| r.id == rpc) else {
            return; // a duplicate, or the answer to a request given up on
        };
        self.mix(7 << 32 | (i as u64) << 8 | rpc);
        let c = &mut self.clients[i];
        c.rpc = None;
        match (c.state.clone(), answer) {
            (
                State::Acquiring(a),
                Answer::Granted {
                    fence,
                    token,
                    ttl_ms,
                },
            ) => {
                let base = a.first_sent.unwrap_or(outstanding.sent);
                let lock = &self.locks[a.lock];
                // Readers read; only a writer of a mutex writes the resource.
                let writes_total = if lock.limit == 1 && a.mode == Mode::Exclusive {
                    c.rng.range(1, 3) as u32
                } else {
                    0
                };
                let hold = grid(c.rng.range(0, ttl_ms));
                self.stats.grants_seen += 1;
                self.stats.session_grants += u64::from(a.session.is_some());
                self.stats.leaderships += u64::from(a.value.is_some());
                c.state = State::Holding(Holding {
                    lock: a.lock,
                    mode: a.mode,
                    session: a.session,
                    ttl_ms,
                    fence,
                    token,
                    deadline: (base + ttl_ms)
                        .saturating_sub(Sim::margin(ttl_ms))
                        .max(base),
                    last_sent: base,
                    // After a long wait the send instant proves little: confirm
                    // with a renewal before using the lock (as the client does).
                    // (A session-held lock lives on the session's lease, whose
                    // deadline the keep-alives keep.)
                    confirmed: a.session.is_some() || self.now - base <= ttl_ms / 4,
                    confirm_until: a.budget_end,
                    writes_done: 0,
                    writes_total,
                    next_write_at: self.now,
                    release_at: self.now + hold,
                    renew_attempt: 0,
                    renew_retry_at: self.now,
                    value: a.value,
                });
            }
            (State::AcquiringAll(a), Answer::GrantedAll { grants, ttl_ms }) => {
                let base = a.first_sent.unwrap_or(outstanding.sent);
                let deadline = (base + ttl_ms)
                    .saturating_sub(Sim::margin(ttl_ms))
                    .max(base);
                let parts: Vec<Part> = a
                    .parts
                    .iter()
                    .zip(grants)
                    .map(|(&(lock, mode), (fence, token))| Part {
                        lock,
                        mode,
                        fence,
                        token,
                    })
                    .collect();
                // Writers of a mutex write the resource once each, fenced by that
                // lock's fence.
                let writes = parts
                    .iter()
                    .filter(|p| p.mode == Mode::Exclusive && self.locks[p.lock].limit == 1)
                    .map(|p| p.lock)
                    .collect();
                self.stats.grants_seen += parts.len() as u64;
                self.stats.multi_grants += 1;
                let left = deadline.saturating_sub(self.now);
                let hold = grid(c.rng.range(0, left));
                let h = HoldingAll {
                    parts,
                    ttl_ms,
                    deadline,
                    writes,
                    next_write_at: self.now,
                    release_at: self.now + hold,
                    one_by_one: c.rng.chance(500),
                };
                if self.now >= deadline {
                    // Granted too late to use: give it back at once.
                    return self.release_parts(i, &h);
                }
                c.state = State::HoldingAll(h);
            }
            (State::AcquiringAll(a), Answer::Failed(failure)) => match failure {
                Failure::Timeout if self.now < a.budget_end => self.send_acquire_all(i),
                Failure::Unavailable => self.acquire_all_retry(i, a),
                _ => self.go_idle(i),
            },
            // A part released one by one was answered: the next follows (a failed
            // one is left to its lease).
            (State::HoldingAll(h), Answer::Released | Answer::Failed(_)) => {
                self.clients[i].state = State::HoldingAll(h);
            }
            (State::Holding(h), Answer::Proclaimed) => {
                self.stats.proclaims += 1;
                self.clients[i].state = State::Holding(h);
            }
            (State::Observing { .. }, Answer::Leader { term, value }) => {
                self.stats.leader_reads += u64::from(term.is_some());
                self.checker.on_observed(i, term, value.as_ref());
                self.go_idle(i);
            }
            (State::Observing { .. }, Answer::Failed(_)) => self.go_idle(i),
            (State::Acquiring(a), Answer::Failed(failure)) => match failure {
                Failure::Timeout if self.now < a.budget_end => {
                    self.send_acquire(i);
                }
                Failure::Unavailable => self.acquire_retry(i, a),
                _ => self.go_idle(i),
            },
            (State::Holding(mut h), Answer::Renewed { ttl_ms }) => {
                if h.confirmed && self.now >= h.deadline {
                    // Sticky: once the deadline passed, the lock is lost.
                    return self.give_up(i, &h);
                }
                let new_deadline = (outstanding.sent + ttl_ms)
                    .saturating_sub(Sim::margin(ttl_ms))
                    .max(outstanding.sent);
                h.deadline = h.deadline.max(new_deadline);
                h.last_sent = outstanding.sent;
                h.confirmed = true;
                h.renew_attempt = 0;
                self.clients[i].state = State::Holding(h);
            }
            // Already acting as a reader since it was sent: nothing changes.
            (State::Holding(h), Answer::Downgraded) => self.clients[i].state = State::Holding(h),
            (State::Holding(_), Answer::Failed(Failure::Unavailable)) => self.renew_transient(i),
            // The client library starts over when the confirmation finds the grant
            // gone; it does not hold the lock either way.
            (State::Holding(h), Answer::Failed(_)) if !h.confirmed => self.go_idle(i),
            (State::Holding(h), Answer::Failed(_)) => self.give_up(i, &h),
            (State::Releasing { .. }, _) => self.go_idle(i),
            (state, answer) => {
                unreachable!("client {i} in {state:?} got {answer:?} for its outstanding request")
            }
        }
    }

    fn session_answer(&mut self, i: usize, outstanding: Rpc, answer: Answer) {
        let now = self.now;
        let delay = self.backoff(i, 1);
        let c = &mut self.clients[i];
        c.session_rpc = None;
        match answer {
            Answer::SessionOpened { id, ttl_ms } => {
                let sent = outstanding.sent;
                c.session = Some(Session {
                    id,
                    ttl_ms,
                    deadline: (sent + ttl_ms).saturating_sub(Sim::margin(ttl_ms)),
                    last_sent: sent,
                    attempt: 0,
                    retry_at: now,
                });
            }
            Answer::KeptAlive { ttl_ms } => {
                if let Some(s) = c.session.as_mut().filter(|s| now < s.deadline) {
                    let sent = outstanding.sent;
                    s.deadline = s
                        .deadline
                        .max((sent + ttl_ms).saturating_sub(Sim::margin(ttl_ms)));
                    s.last_sent = sent;
                    s.attempt = 0;
                }
            }
            Answer::Failed(Failure::NotHeld) => {
                // The server no longer knows the session: everything on it is gone.
                c.session = None;
            }
            Answer::Failed(_) => match c.session.as_mut() {
                Some(s) => {
                    s.attempt += 1;
                    s.retry_at = now + delay;
                }
                None => c.open_retry_at = now + delay,
            },
            Answer::SessionClosed => {}
            other => unreachable!("client {i} got {other:?} for a session request"),
        }
    }

    fn send_session_request(&mut self, i: usize, request: Request, timeout_ms: u64) {
        let c = &mut self.clients[i];
        c.rpc_seq += 1;
        let rpc = c.rpc_seq;
        c.session_rpc = Some(Rpc {
            id: rpc,
            sent: self.now,
            timeout_at: self.now + timeout_ms,
        });
        self.stats.ops += 1;
        self.send(Ev::ToServer {
            from: i,
            rpc,
            request,
        });
    }

    /// The session task of a session client: open, keep alive every third of the
    /// TTL, give up at the conservative deadline, close when done.
    fn session_step(&mut self, i: usize) {
        let now = self.now;
        let active = self.in_fault_phase();
        let delay = self.backoff(i, 2);
        let c = &mut self.clients[i];
        if !c.uses_session || c.dead {
            return;
        }
        if c.session_rpc.as_ref().is_some_and(|r| now >= r.timeout_at) {
            c.session_rpc = None;
            match c.session.as_mut() {
                Some(s) => s.retry_at = now + delay,
                None => c.open_retry_at = now + delay,
            }
        }
        if c.session_rpc.is_some() {
            return;
        }
        match c.session.clone() {
            None => {
                if active && now >= c.open_retry_at && matches!(c.state, State::Idle { .. }) {
                    let ttl_ms = self.ttls[c.rng.index(self.ttls.len())];
                    self.send_session_request(i, Request::OpenSession { ttl_ms }, RPC_TIMEOUT_MS);
                }
            }
            Some(s) if now >= s.deadline => c.session = None,
            Some(s) if !active && matches!(c.state, State::Idle { .. }) => {
                c.session = None;
                self.send_session_request(i, Request::CloseSession { id: s.id }, RPC_TIMEOUT_MS);
            }
            Some(s) => {
                if now >= s.last_sent + s.ttl_ms / 3 && now >= s.retry_at {
                    let timeout = s.deadline - now;
                    self.send_session_request(i, Request::KeepAlive { id: s.id }, timeout);
                }
            }
        }
    }

    /// The instant a hold stops being valid for its client: its own deadline, or its
    /// session's (0 once the session is gone).
    pub(super) fn hold_deadline(c: &Client, h: &Holding) -> u64 {
        match h.session {
            None => h.deadline,
            Some(id) => c
                .session
                .as_ref()
                .filter(|s| s.id == id)
                .map_or(0, |s| s.deadline),
        }
    }

    /// A renewal failed transiently: retry after a backoff (a confirmed hold until
    /// its deadline, a confirmation within the wait budget).
    fn renew_transient(&mut self, i: usize) {
        let State::Holding(h) = self.clients[i].state.clone() else {
            return;
        };
        let delay = self.backoff(i, h.renew_attempt);
        if !h.confirmed && self.now + delay >= h.confirm_until {
            return self.give_up(i, &h);
        }
        if let State::Holding(h) = &mut self.clients[i].state {
            h.renew_attempt += 1;
            h.renew_retry_at = self.now + delay;
        }
    }

    /// A transient failure: retry with backoff within the wait budget, as the client
    /// library does (a try-lock, with no budget, gives up at once).
    fn acquire_retry(&mut self, i: usize, a: Acquiring) {
        let delay = self.backoff(i, a.attempt);
        if self.now + delay >= a.budget_end {
            return self.go_idle(i);
        }
        if let State::Acquiring(a) = &mut self.clients[i].state {
            a.attempt += 1;
            a.retry_at = self.now + delay;
        }
    }

    /// [`Sim::acquire_retry`] for a multi-lock request.
    fn acquire_all_retry(&mut self, i: usize, a: AcquiringAll) {
        let delay = self.backoff(i, a.attempt);
        if self.now + delay >= a.budget_end {
            return self.go_idle(i);
        }
        if let State::AcquiringAll(a) = &mut self.clients[i].state {
            a.attempt += 1;
            a.retry_at = self.now + delay;
        }
    }

    /// A multi-lock holder: writes once per exclusive part of a mutex while its
    /// deadline has not passed, then releases (together or one by one); at the
    /// deadline it gives up whatever is left.
    fn holding_all_step(&mut self, i: usize, mut h: HoldingAll, timed_out: bool) -> bool {
        let now = self.now;
        if now >= h.deadline {
            self.stats.deadline_losses += 1;
            self.clients[i].rpc = None;
            self.release_parts(i, &h);
            return true;
        }
        if timed_out {
            // A one-by-one release got no answer: its lease will free the part.
            self.clients[i].rpc = None;
        }
        if self.clients[i].rpc.is_some() {
            return false;
        }
        if !h.writes.is_empty() && now >= h.next_write_at {
            let lock = h.writes.remove(0);
            let fence = h
                .parts
                .iter()
                .find(|p| p.lock == lock)
                .map_or(0, |p| p.fence);
            let key = format!("{}/0", self.locks[lock].name);
            let c = &mut self.clients[i];
            h.next_write_at = now + grid(c.rng.range(10, 60));
            let mut at = now + grid(c.rng.range(1, 20));
            if self.now < self.fault_end && c.rng.chance(self.plan.stall_pm) {
                let stall = grid(c.rng.range(h.ttl_ms / 2, 3 * h.ttl_ms));
                c.paused_until = c.paused_until.max(now + stall);
                at += stall;
                self.stats.faults.stall += 1;
            }
            self.stats.writes += 1;
            self.clients[i].state = State::HoldingAll(h);
            self.schedule(
                at,
                super::Ev::ToResource {
                    from: i,
                    key,
                    fence,
                },
            );
            return true;
        }
        if h.writes.is_empty() && now >= h.release_at {
            if !h.one_by_one || h.parts.len() <= 1 {
                self.release_parts(i, &h);
                return true;
            }
            // One by one: the client stops believing it holds a part as it sends
            // the part's release.
            let p = h.parts.remove(0);
            let name = self.locks[p.lock].name.clone();
            self.clients[i].state = State::HoldingAll(h);
            self.send_request(
                i,
                Request::Release {
                    name,
                    token: p.token,
                },
                RPC_TIMEOUT_MS,
            );
            return false;
        }
        self.clients[i].state = State::HoldingAll(h);
        false
    }

    /// Acts on the client's state at `now`, then sets its next wake-up.
    pub(super) fn client_step(&mut self, i: usize) {
        let now = self.now;
        let active = self.in_fault_phase();
        self.session_step(i);
        for _ in 0..4 {
            let c = &mut self.clients[i];
            if c.dead {
                return;
            }
            let timed_out = c.rpc.as_ref().is_some_and(|r| now >= r.timeout_at);
            match c.state.clone() {
                State::Idle { next_at } => {
                    if now < next_at || !active || c.uses_session && c.session.is_none() {
                        break;
                    }
                    match c.role {
                        Role::Single => {}
                        Role::Multi => {
                            self.start_multi(i);
                            break;
                        }
                        Role::Elector => {
                            self.start_elector(i);
                            break;
                        }
                    }
                    let session = c.session.as_ref().map(|s| s.id);
                    let lock = c.rng.index(self.plain);
                    let ttl_ms = self.ttls[c.rng.index(self.ttls.len())];
                    let wait_ms = self.waits[c.rng.index(self.waits.len())];
                    c.requests += 1;
                    let request_id =
                        RequestId::new(&format!("c{i}-{}", c.requests)).expect("valid");
                    let lock_delay_ms = [0, 0, 0, 50, 100][c.rng.index(5)];
                    // Drawn only on a reader-writer lock: other locks' runs stay
                    // as they were.
                    let mode = if self.locks[lock].rw && c.rng.chance(500) {
                        Mode::Shared
                    } else {
                        Mode::Exclusive
                    };
                    c.state = State::Acquiring(Acquiring {
                        lock,
                        mode,
                        lock_delay_ms,
                        session,
                        ttl_ms,
                        request_id,
                        first_sent: None,
                        budget_end: now + wait_ms,
                        attempt: 0,
                        retry_at: now,
                        value: None,
                    });
                    self.send_acquire(i);
                    break;
                }
                State::AcquiringAll(a) => {
                    if timed_out {
                        c.rpc = None;
                        self.acquire_all_retry(i, a);
                        continue;
                    }
                    if c.rpc.is_none() && now >= a.retry_at {
                        self.send_acquire_all(i);
                    }
                    break;
                }
                State::HoldingAll(h) => {
                    if self.holding_all_step(i, h, timed_out) {
                        continue;
                    }
                    break;
                }
                State::Observing { give_up } => {
                    if timed_out || now >= give_up {
                        self.go_idle(i);
                        continue;
                    }
                    break;
                }
                State::Acquiring(a) => {
                    if a.session.is_some() && a.session != c.session.as_ref().map(|s| s.id) {
                        // The session ended under the request: start over.
                        self.go_idle(i);
                        continue;
                    }
                    if timed_out {
                        c.rpc = None;
                        self.acquire_retry(i, a);
                        continue;
                    }
                    if c.rpc.is_none() && now >= a.retry_at {
                        self.send_acquire(i);
                    }
                    break;
                }
                State::Holding(mut h) => {
                    if h.confirmed && now >= Sim::hold_deadline(c, &h) {
                        self.stats.deadline_losses += 1;
                        self.give_up(i, &h);
                        continue;
                    }
                    if timed_out {
                        // A renewal that got no answer (a confirmed hold's renewal
                        // times out only at its deadline, handled above).
                        c.rpc = None;
                        self.renew_transient(i);
                        continue;
                    }
                    let renew_due =
                        h.session.is_none() && (!h.confirmed || now >= h.last_sent + h.ttl_ms / 3);
                    if c.rpc.is_none() && renew_due && now >= h.renew_retry_at {
                        let request = Request::Renew {
                            name: self.locks[h.lock].name.clone(),
                            token: h.token,
                            ttl_ms: h.ttl_ms,
                        };
                        let timeout = if h.confirmed {
                            h.deadline - now
                        } else {
                            RPC_TIMEOUT_MS
                        };
                        self.send_request(i, request, timeout);
                    }
                    let c = &mut self.clients[i];
                    if !h.confirmed {
                        break;
                    }
                    if h.writes_done < h.writes_total && now >= h.next_write_at {
                        // The deadline was checked above; a stall between that check
                        // and the write reaching the resource is exactly what fences
                        // are for.
                        let key = format!("{}/{}", self.locks[h.lock].name, h.writes_done);
                        h.writes_done += 1;
                        h.next_write_at = now + grid(c.rng.range(10, 60));
                        let mut at = now + grid(c.rng.range(1, 20));
                        if self.now < self.fault_end && c.rng.chance(self.plan.stall_pm) {
                            let stall = grid(c.rng.range(h.ttl_ms / 2, 3 * h.ttl_ms));
                            c.paused_until = c.paused_until.max(now + stall);
                            at += stall;
                            self.stats.faults.stall += 1;
                        }
                        self.stats.writes += 1;
                        c.state = State::Holding(h.clone());
                        self.schedule(
                            at,
                            Ev::ToResource {
                                from: i,
                                key,
                                fence: h.fence,
                            },
                        );
                        continue;
                    }
                    // An election's leader may publish a new value while it leads.
                    let may_proclaim = h.value.is_some()
                        && c.rpc.is_none()
                        && h.writes_done >= h.writes_total
                        && now < h.release_at;
                    if may_proclaim && c.rng.chance(300) {
                        let value = Value::new(&format!("c{i}-{}-p{}", c.requests, h.fence))
                            .expect("valid");
                        h.value = Some(value.clone());
                        let request = Request::Proclaim {
                            name: self.locks[h.lock].name.clone(),
                            token: h.token,
                            value,
                        };
                        self.clients[i].state = State::Holding(h);
                        self.send_request(i, request, RPC_TIMEOUT_MS);
                        break;
                    }
                    // A writer of a reader-writer lock that has written may turn
                    // reader before it releases. It acts as a reader from the send
                    // on: the server may let readers in before the answer arrives.
                    let may_downgrade = self.locks[h.lock].rw
                        && h.mode == Mode::Exclusive
                        && c.rpc.is_none()
                        && h.writes_done >= h.writes_total
                        && now < h.release_at;
                    if may_downgrade && c.rng.chance(500) {
                        h.mode = Mode::Shared;
                        let request = Request::Downgrade {
                            name: self.locks[h.lock].name.clone(),
                            token: h.token,
                        };
                        self.clients[i].state = State::Holding(h);
                        self.send_request(i, request, RPC_TIMEOUT_MS);
                        break;
                    }
                    let c = &mut self.clients[i];
                    if h.writes_done >= h.writes_total && now >= h.release_at {
                        let name = self.locks[h.lock].name.clone();
                        c.state = State::Releasing {
                            give_up: now + RPC_TIMEOUT_MS,
                        };
                        self.send_request(
                            i,
                            Request::Release {
                                name,
                                token: h.token,
                            },
                            RPC_TIMEOUT_MS,
                        );
                    }
                    break;
                }
                State::Releasing { give_up } => {
                    if timed_out || now >= give_up {
                        self.go_idle(i);
                        continue;
                    }
                    break;
                }
            }
        }
        self.rewake(i);
    }

    /// The next instant the client has something to do.
    fn rewake(&mut self, i: usize) {
        let c = &self.clients[i];
        if c.dead {
            return;
        }
        let mut next = c.rpc.as_ref().map(|r| r.timeout_at);
        let mut at = |t: u64| next = Some(next.map_or(t, |n: u64| n.min(t)));
        let idle = matches!(c.state, State::Idle { .. });
        let active = self.now < self.fault_end;
        if c.uses_session {
            match (&c.session_rpc, &c.session) {
                (Some(r), _) => at(r.timeout_at),
                (None, Some(s)) => {
                    at(s.deadline);
                    at((s.last_sent + s.ttl_ms / 3).max(s.retry_at).max(self.now));
                    if idle && !active {
                        at(self.now); // time to close it
                    }
                }
                (None, None) => {
                    if idle && active {
                        at(c.open_retry_at.max(self.now));
                    }
                }
            }
        }
        match &c.state {
            State::Idle { next_at } => {
                if active && (!c.uses_session || c.session.is_some()) {
                    at((*next_at).max(self.now));
                }
            }
            State::Acquiring(a) => {
                if c.rpc.is_none() {
                    at(a.retry_at.max(self.now));
                }
            }
            State::Holding(h) => {
                if h.confirmed {
                    at(Sim::hold_deadline(c, h));
                }
                if c.rpc.is_none() && h.session.is_none() {
                    at((h.last_sent + h.ttl_ms / 3)
                        .max(h.renew_retry_at)
                        .max(self.now));
                }
                if h.confirmed {
                    if h.writes_done < h.writes_total {
                        at(h.next_write_at.max(self.now));
                    } else {
                        at(h.release_at.max(self.now));
                    }
                }
            }
            State::AcquiringAll(a) => {
                if c.rpc.is_none() {
                    at(a.retry_at.max(self.now));
                }
            }
            State::HoldingAll(h) => {
                at(h.deadline);
                if c.rpc.is_none() {
                    if h.writes.is_empty() {
                        at(h.release_at.max(self.now));
                    } else {
                        at(h.next_write_at.max(self.now));
                    }
                }
            }
            State::Observing { give_up } => at(*give_up),
            State::Releasing { give_up } => at(*give_up),
        }
        let paused_until = c.paused_until;
        if let Some(t) = next {
            self.wake_client(i, t.max(paused_until).max(self.now));
        }
    }
}
