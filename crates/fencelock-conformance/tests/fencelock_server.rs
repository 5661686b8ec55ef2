//! The conformance suite against the fencelock server itself.

mod support;

fencelock_conformance::conformance_suite!(support::start());
