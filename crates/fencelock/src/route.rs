//! Which cluster member a request goes to next: the pure decision behind
//! [`FencelockBackend`](crate::FencelockBackend)'s failover, kept free of I/O so it
//! can be tested alone.
//!
//! A request starts at the member that last answered. A member that is not the leader
//! answers `not_leader`, naming the leader's URL when it knows it: the request follows
//! the name (even to a URL it was not given, which is added). A member that cannot be
//! reached, is shutting down, or knows no leader sends the request on to the next
//! endpoint in the list. Each member is tried at most once per round. Between rounds
//! the backend backs off (`Backoff`) and starts again while the cluster is between
//! leaders (some member answered `not_leader`), within the call's deadline; the
//! caller's own retries (the acquire loop, the renewer) cover the rest.

/// Most endpoints a client keeps: the configured ones plus leaders named by members.
/// Beyond it a named leader is not added (the request moves on through the list).
pub(crate) const MAX_ENDPOINTS: usize = 32;

/// How a call to one member failed, as far as choosing the next member goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Failure<'a> {
    /// `not_leader`, with the leader's URL when the member knows it.
    NotLeader(Option<&'a str>),
    /// No answer: connection refused or broken, timeout, or the member is stopping.
    Unreachable,
    /// Any other answer: the request got through, no other member would do better.
    Final,
}

/// Where to send the request next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Next {
    /// The endpoint at this index of the list.
    Endpoint(usize),
    /// A leader URL the list does not hold yet: add it, then send there.
    Add(String),
    /// Give up this round and return the failure to the caller.
    Stop,
}

/// One request's way through the endpoints.
#[derive(Debug, Clone)]
pub(crate) struct Route {
    /// The endpoint being tried.
    current: usize,
    /// Endpoints that already failed this request (by index).
    tried: Vec<bool>,
}

/// The same endpoint written two ways (`http://h:1/` and `http://h:1`) is one.
pub(crate) fn normalize(url: &str) -> String {
    url.trim().trim_end_matches('/').to_owned()
}

/// The endpoints of a comma-separated list, normalized, without empties or repeats.
pub(crate) fn split_list(list: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for url in list.split(',').map(normalize) {
        if !url.is_empty() && !out.contains(&url) {
            out.push(url);
        }
    }
    out
}

impl Route {
    /// A request that starts at endpoint `start` of a list of `len`.
    pub(crate) fn new(start: usize, len: usize) -> Route {
        Route {
            current: if len == 0 { 0 } else { start % len },
            tried: vec![false; len],
        }
    }

    /// The endpoint being tried.
    pub(crate) fn current(&self) -> usize {
        self.current
    }

    /// Moves to endpoint `i` (where an added endpoint really landed, when another
    /// request added one meanwhile).
    pub(crate) fn relocate(&mut self, i: usize) {
        if self.tried.len() <= i {
            self.tried.resize(i + 1, false);
        }
        self.current = i;
    }

    /// The call to [`current`](Route::current) failed with `failure`; `endpoints` is
    /// the list as it is now (it may have grown since the request started). Returns
    /// where to go next, and moves there.
    pub(crate) fn after(&mut self, endpoints: &[String], failure: Failure<'_>) -> Next {
        if self.tried.len() < endpoints.len() {
            self.tried.resize(endpoints.len(), false);
        }
        if let Some(tried) = self.tried.get_mut(self.current) {
            *tried = true;
        }
        let leader = match failure {
            Failure::Final => return Next::Stop,
            Failure::Unreachable | Failure::NotLeader(None) => None,
            Failure::NotLeader(Some(url)) => Some(normalize(url)).filter(|u| !u.is_empty()),
        };
        if let Some(leader) = leader {
            match endpoints.iter().position(|e| *e == leader) {
                // A leader already tried in this request failed (it may be the one
                // that just died, named by a member that has not noticed yet).
                Some(i) if self.tried.get(i).copied().unwrap_or(true) => {}
                Some(i) => {
                    self.current = i;
                    return Next::Endpoint(i);
                }
                None if endpoints.len() < MAX_ENDPOINTS => {
                    self.current = endpoints.len();
                    self.tried.push(false);
                    return Next::Add(leader);
                }
                None => {}
            }
        }
        // The next endpoint after this one, in list order, not yet tried.
        let len = endpoints.len();
        for step in 1..=len {
            let i = (self.current + step) % len;
            if !self.tried.get(i).copied().unwrap_or(true) {
                self.current = i;
                return Next::Endpoint(i);
            }
        }
        Next::Stop
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn list(n: usize) -> Vec<String> {
        (0..n)
            .map(|i| format!("http://127.0.0.1:{}", 7420 + i))
            .collect()
    }

    #[test]
    fn lists_are_split_normalized_and_deduplicated() {
        assert_eq!(
            split_list(" http://a:1/, http://b:2 ,,http://a:1"),
            ["http://a:1", "http://b:2"]
        );
        assert_eq!(split_list("http://a:1"), ["http://a:1"]);
        assert!(split_list(" , ").is_empty());
    }

    #[test]
    fn a_named_leader_is_followed_at_once() {
        let endpoints = list(3);
        let mut route = Route::new(0, 3);
        let next = route.after(
            &endpoints,
            Failure::NotLeader(Some("http://127.0.0.1:7422/")),
        );
        assert_eq!(next, Next::Endpoint(2));
        assert_eq!(route.current(), 2);
    }

    #[test]
    fn an_unknown_leader_url_is_added_and_followed() {
        let mut endpoints = list(2);
        let mut route = Route::new(1, 2);
        let next = route.after(&endpoints, Failure::NotLeader(Some("http://10.0.0.9:7420")));
        assert_eq!(next, Next::Add("http://10.0.0.9:7420".into()));
        endpoints.push("http://10.0.0.9:7420".into());
        assert_eq!(route.current(), 2);
        // The new endpoint fails too: the round goes on with the one not yet tried.
        assert_eq!(
            route.after(&endpoints, Failure::Unreachable),
            Next::Endpoint(0)
        );
        assert_eq!(route.after(&endpoints, Failure::Unreachable), Next::Stop);
    }

    #[test]
    fn unreachable_or_leaderless_members_pass_to_the_next_once_per_round() {
        let endpoints = list(3);
        let mut route = Route::new(1, 3);
        assert_eq!(
            route.after(&endpoints, Failure::Unreachable),
            Next::Endpoint(2)
        );
        assert_eq!(
            route.after(&endpoints, Failure::NotLeader(None)),
            Next::Endpoint(0)
        );
        assert_eq!(route.after(&endpoints, Failure::Unreachable), Next::Stop);
    }

    #[test]
    fn a_leader_already_failed_in_this_request_is_not_followed_again() {
        // The leader (0) was killed; member 1 still names it.
        let endpoints = list(3);
        let mut route = Route::new(0, 3);
        assert_eq!(
            route.after(&endpoints, Failure::Unreachable),
            Next::Endpoint(1)
        );
        let stale = Failure::NotLeader(Some("http://127.0.0.1:7420"));
        assert_eq!(route.after(&endpoints, stale), Next::Endpoint(2));
        // Member 2 names the new leader, 1, which answered not_leader before it knew:
        // tried already, and nothing is left this round.
        let named = Failure::NotLeader(Some("http://127.0.0.1:7421"));
        assert_eq!(route.after(&endpoints, named), Next::Stop);
    }

    #[test]
    fn a_final_answer_stops_and_a_single_endpoint_makes_one_attempt() {
        let endpoints = list(3);
        assert_eq!(
            Route::new(0, 3).after(&endpoints, Failure::Final),
            Next::Stop
        );
        let one = list(1);
        assert_eq!(
            Route::new(0, 1).after(&one, Failure::Unreachable),
            Next::Stop
        );
        // Even a single endpoint follows a named leader.
        let next = Route::new(0, 1).after(&one, Failure::NotLeader(Some("http://b:1")));
        assert_eq!(next, Next::Add("http://b:1".into()));
    }

    #[test]
    fn every_route_ends_within_one_round_of_the_list() {
        // Whatever members answer, a request visits each endpoint at most once.
        let endpoints = list(5);
        let answers = [
            Failure::Unreachable,
            Failure::NotLeader(None),
            Failure::NotLeader(Some("http://127.0.0.1:7420")),
            Failure::NotLeader(Some("http://127.0.0.1:7424")),
        ];
        for start in 0..5 {
            for pick in 0..answers.len() {
                let mut route = Route::new(start, 5);
                let mut visits = 1;
                while let Next::Endpoint(_) = route.after(&endpoints, answers[(pick + visits) % 4])
                {
                    visits += 1;
                    assert!(visits <= 5, "start {start}, pick {pick}: {visits} visits");
                }
            }
        }
    }

    #[test]
    fn the_list_never_grows_past_its_bound() {
        let endpoints = list(MAX_ENDPOINTS);
        let mut route = Route::new(0, MAX_ENDPOINTS);
        let next = route.after(&endpoints, Failure::NotLeader(Some("http://elsewhere:1")));
        assert_eq!(next, Next::Endpoint(1));
    }
}
