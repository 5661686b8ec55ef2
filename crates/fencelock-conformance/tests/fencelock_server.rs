//! The conformance suite against the fencelock server itself.

use crate::support;

fencelock_conformance::conformance_suite!(support::start());
