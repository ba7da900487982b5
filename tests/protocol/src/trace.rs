//! Counterexamples and examples, printed step by step: each action, then the key it touched
//! as the store holds it, its holders, and the workers' listings.

use std::fmt::Write;

use stateright::Path;

use crate::store::{Answer, Point, Record, Token};
use crate::{Action, By, Holder, Key, Phase, State};

/// `path` as numbered steps, up to its first state where `holds` is false (a checker may
/// report a path that goes on past it).
pub fn render_until(path: &Path<State, Action>, holds: impl Fn(&State) -> bool) -> String {
    let mut steps = path.clone().into_vec();
    if let Some(first) = steps.iter().position(|(s, _)| !holds(s)) {
        steps.truncate(first + 1);
    }
    render_steps(&steps)
}

/// `path` as numbered steps.
pub fn render(path: &Path<State, Action>) -> String {
    render_steps(&path.clone().into_vec())
}

fn render_steps(steps: &[(State, Option<Action>)]) -> String {
    let mut out = String::new();
    for (n, pair) in steps.windows(2).enumerate() {
        let n = n + 1;
        // The action that led to a state is stored with the state before it.
        let (prev, action) = (&pair[0].0, pair[0].1.expect("a step has an action"));
        let state = &pair[1].0;
        let _ = writeln!(out, "{n:>3}. {}", action_text(prev, action));
        for (i, k) in state.keys.iter().enumerate() {
            if Some(k) != prev.keys.get(i) || touches(action, i as u8) {
                let _ = writeln!(out, "       key {i}: {}", key_text(k));
            }
        }
        for (w, worker) in state.workers.iter().enumerate() {
            if Some(worker) != prev.workers.get(w) && !worker.listed.is_empty() {
                let listed: Vec<String> = worker
                    .listed
                    .iter()
                    .map(|l| {
                        format!(
                            "key {} at g{} fp{} {}",
                            l.key,
                            l.gen,
                            l.fp,
                            point_text(l.point)
                        )
                    })
                    .collect();
                let _ = writeln!(out, "       worker {w} listed: {}", listed.join(", "));
            }
        }
    }
    out
}

fn touches(action: Action, key: u8) -> bool {
    match action {
        Action::List { .. } => false,
        Action::Send { key: k, .. }
        | Action::Save { key: k, .. }
        | Action::Renew { key: k, .. }
        | Action::Complete { key: k, .. }
        | Action::Release { key: k, .. }
        | Action::Resend { key: k, .. }
        | Action::Pause { key: k, .. }
        | Action::Wake { key: k, .. }
        | Action::Crash { key: k, .. }
        | Action::Recover { key: k, .. }
        | Action::GiveBack { key: k, .. }
        | Action::Lapse { key: k }
        | Action::Expire { key: k }
        | Action::ForceRelease { key: k }
        | Action::Delete { key: k } => k == key,
    }
}

fn who(state: &State, key: u8, nonce: u8) -> String {
    state.keys[key as usize]
        .holders
        .iter()
        .find(|h| h.token.nonce == nonce)
        .map_or_else(|| format!("#{nonce}"), holder_name)
}

fn holder_name(h: &Holder) -> String {
    let by = match h.by {
        By::Client => "client".to_owned(),
        By::Worker(w) => format!("worker {w}"),
    };
    format!("{by} {}", token_text(h.token))
}

fn action_text(prev: &State, action: Action) -> String {
    let lost = |l: bool| if l { " (reply lost)" } else { "" };
    match action {
        Action::Send { key, fp, lost: l } => {
            format!(
                "client sends a request on key {key} with fingerprint {fp}{}",
                lost(l)
            )
        }
        Action::Save { key, nonce } => format!("{} saves a recovery point", who(prev, key, nonce)),
        Action::Renew { key, nonce } => format!("{} renews its lease", who(prev, key, nonce)),
        Action::Complete {
            key,
            nonce,
            lost: l,
        } => format!("{} completes{}", who(prev, key, nonce), lost(l)),
        Action::Release {
            key,
            nonce,
            lost: l,
        } => format!("{} releases (5xx){}", who(prev, key, nonce), lost(l)),
        Action::Resend { key, nonce } => format!("{} sends again", who(prev, key, nonce)),
        Action::Pause { key, nonce } => format!("{} pauses", who(prev, key, nonce)),
        Action::Wake { key, nonce } => format!("{} wakes up", who(prev, key, nonce)),
        Action::Crash { key, nonce } => format!("{} stops for good", who(prev, key, nonce)),
        Action::List { worker } => format!("worker {worker} lists the recoverable records"),
        Action::Recover {
            worker,
            key,
            lost: l,
        } => format!("worker {worker} claims key {key}, then decides{}", lost(l)),
        Action::GiveBack { key, nonce, effect } => format!(
            "{} gives its claim back{}",
            who(prev, key, nonce),
            if effect {
                ""
            } else {
                " (timed out, no effect)"
            }
        ),
        Action::Lapse { key } => format!("the lease on key {key} lapses"),
        Action::Expire { key } => format!("key {key}'s TTL passes"),
        Action::ForceRelease { key } => format!("the operator force-releases key {key}"),
        Action::Delete { key } => format!("the operator deletes key {key}"),
    }
}

fn token_text(t: Token) -> String {
    format!("g{}#{}", t.gen, t.nonce)
}

fn point_text(p: Point) -> String {
    format!("point(step {} by {})", p.step, token_text(p.by))
}

fn answer_text(a: Answer) -> String {
    format!(
        "answer of {}{}",
        token_text(a.by),
        if a.worker { " (worker)" } else { "" }
    )
}

fn key_text(k: &Key) -> String {
    let record = match k.record {
        Record::Absent => "absent".to_owned(),
        Record::InProgress(r) => format!(
            "in progress {} fp{} {}{}{}",
            token_text(r.token),
            r.fp,
            if r.live { "live" } else { "lapsed" },
            r.point
                .map_or(String::new(), |p| format!(" {}", point_text(p))),
            if r.released { " released" } else { "" }
        ),
        Record::Completed { answer, fp } => format!("completed fp{fp} {}", answer_text(answer)),
    };
    let holders: Vec<String> = k
        .holders
        .iter()
        .map(|h| {
            let phase = match h.phase {
                Phase::Running => "running",
                Phase::Paused => "paused",
                Phase::Completing => "resending complete",
                Phase::Releasing => "resending release",
                Phase::Unclaimed => "unaware of its claim",
                Phase::GivingBack => "giving back",
            };
            format!("{} {phase}", holder_name(h))
        })
        .collect();
    let lineage: Vec<String> = k.lineage.iter().map(|p| point_text(*p)).collect();
    format!(
        "{record}; holders [{}]; lineage since the last release [{}]; {} attempts left",
        holders.join(", "),
        lineage.join(", "),
        k.attempts_left
    )
}
