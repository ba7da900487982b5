//! The protocol model, checked over every interleaving within its bounds.

use std::collections::BTreeSet;
use std::time::Instant;

use stateright::{Checker, Expectation, HasDiscoveries, Model, Path};
use tower_idempotency_protocol::properties::{CURRENT_LINEAGE, NO_RECREATION, WITHIN_CAP};
use tower_idempotency_protocol::{
    representative, trace, Action, Bounds, Phase, Protocol, State, WorkerLogic,
};

/// The cores CI gives a job.
const THREADS: usize = 2;

/// Every property holds in every state reachable under `bounds` (depth-first, with the
/// symmetry reduction of [`representative`]), and every `sometimes` is reached.
fn check_all(bounds: Bounds) {
    let model = Protocol::new(bounds, WorkerLogic::Claimed);
    let started = Instant::now();
    let checker = model
        .checker()
        .symmetry_fn(representative)
        .threads(THREADS)
        .spawn_dfs()
        .join();
    println!(
        "{bounds:?}\n  {} unique states ({} generated), in {:.1?}",
        checker.unique_state_count(),
        checker.state_count(),
        started.elapsed()
    );
    for p in checker.model().properties() {
        let verdict = match (&p.expectation, checker.discovery(p.name).is_some()) {
            (Expectation::Sometimes, true) => "reached",
            (Expectation::Sometimes, false) => "NOT REACHED",
            (_, false) => "holds",
            (_, true) => "BROKEN",
        };
        println!("  {verdict:>11}: {}", p.name);
    }
    checker.assert_properties();
}

#[test]
fn the_protocol_holds_every_property_within_its_bounds() {
    check_all(Bounds::ONE_KEY);
    check_all(Bounds::TWO_KEYS);
}

/// Whether `name` holds in `state`.
fn holds(model: &Protocol, name: &'static str, state: &State) -> bool {
    (model.property(name).condition)(model, state)
}

#[test]
fn the_old_worker_logic_breaks_the_protocol() {
    let model = Protocol::new(Bounds::ONE_KEY, WorkerLogic::Listed);
    let expected = [CURRENT_LINEAGE, WITHIN_CAP, NO_RECREATION];
    let started = Instant::now();
    // Breadth-first on one thread, so the counterexamples are short.
    let checker = model
        .checker()
        .finish_when(HasDiscoveries::AllOf(BTreeSet::from(expected)))
        .spawn_bfs()
        .join();
    println!(
        "{:?}, WorkerLogic::Listed\n  {} unique states ({} generated), in {:.1?}",
        Bounds::ONE_KEY,
        checker.unique_state_count(),
        checker.state_count(),
        started.elapsed()
    );
    for name in expected {
        let path = checker
            .discovery(name)
            .unwrap_or_else(|| panic!("the old logic should break \"{name}\""));
        let trace = trace::render_until(&path, |s| holds(&model, name, s));
        println!("\ncounterexample to \"{name}\":\n{trace}");
    }
}

use Action::*;

/// Key 0's first request claims (nonce 1), saves a point, and dies; its lease lapses; the
/// worker lists it.
fn a_holder_dies_after_its_point_and_is_listed() -> Vec<Action> {
    vec![
        Send {
            key: 0,
            fp: 0,
            lost: false,
        },
        Save { key: 0, nonce: 1 },
        Crash { key: 0, nonce: 1 },
        Lapse { key: 0 },
        List { worker: 0 },
    ]
}

/// The review's stale-listing scenarios (issue 45, points 1-3): what happens between the
/// worker's listing and its claim, and the property the old logic breaks then.
fn the_reviews_scenarios() -> Vec<(&'static str, Bounds, Vec<Action>, &'static str)> {
    let recover = Recover {
        worker: 0,
        key: 0,
        lost: false,
    };
    let with = |between: &[Action]| {
        let mut actions = a_holder_dies_after_its_point_and_is_listed();
        actions.extend_from_slice(between);
        actions.push(recover);
        actions
    };
    // A cap of 3, so that the release alone breaks something.
    let cap_3 = Bounds {
        cap: 3,
        ..Bounds::ONE_KEY
    };
    vec![
        (
            "a retry takes over, answers 5xx and is released, which drops the point",
            cap_3,
            with(&[
                Send {
                    key: 0,
                    fp: 0,
                    lost: false,
                },
                Release {
                    key: 0,
                    nonce: 2,
                    lost: false,
                },
            ]),
            CURRENT_LINEAGE,
        ),
        (
            "a retry takes over (generation 2 of a cap of 2) and dies",
            Bounds::ONE_KEY,
            with(&[
                Send {
                    key: 0,
                    fp: 0,
                    lost: false,
                },
                Crash { key: 0, nonce: 2 },
                Lapse { key: 0 },
            ]),
            WITHIN_CAP,
        ),
        (
            "the operator force-releases the record",
            Bounds::ONE_KEY,
            with(&[ForceRelease { key: 0 }]),
            NO_RECREATION,
        ),
        (
            "the record expires",
            Bounds::ONE_KEY,
            with(&[Expire { key: 0 }]),
            NO_RECREATION,
        ),
    ]
}

#[test]
fn the_reviews_stale_listing_scenarios_break_the_old_logic_and_not_the_new() {
    for (what, bounds, actions, broken) in the_reviews_scenarios() {
        let old = Protocol::new(bounds, WorkerLogic::Listed);
        let init = old.init_states().remove(0);
        let path = Path::from_actions(&old, init.clone(), &actions)
            .unwrap_or_else(|| panic!("{what}: the actions are not a path of the model"));
        let last = path.last_state();
        assert!(
            !holds(&old, broken, last),
            "{what}: \"{broken}\" should break"
        );
        println!(
            "\nold logic, {what}: breaks \"{broken}\"\n{}",
            trace::render(&path)
        );

        // The new logic, after the same history: the worker gives its claim back, and
        // every property holds.
        let new = Protocol::new(bounds, WorkerLogic::Claimed);
        let path = Path::from_actions(&new, init, &actions)
            .unwrap_or_else(|| panic!("{what}: the actions are not a path of the model"));
        let last = path.last_state();
        for p in new.properties() {
            if p.expectation == Expectation::Always {
                assert!(
                    (p.condition)(&new, last),
                    "{what}: the new logic breaks \"{}\"",
                    p.name
                );
            }
        }
        let gives_back = last.keys[0]
            .holders
            .iter()
            .any(|h| h.phase == Phase::GivingBack);
        assert!(
            gives_back,
            "{what}: the new logic's worker should give its claim back"
        );
    }
}
