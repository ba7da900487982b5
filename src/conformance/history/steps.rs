//! What a history is made of, and how a seed makes one.

use super::*;

/// What a history may contain.
#[derive(Debug, Clone, Copy)]
pub(super) struct Shape {
    pub(super) points: bool,
    pub(super) admin: bool,
    pub(super) max_steps: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Len {
    Short,
    Long,
}

impl Len {
    pub(super) fn duration(self) -> Duration {
        match self {
            Len::Short => SHORT,
            Len::Long => LONG,
        }
    }
}

/// Which token a step sends: the key's token `n` claims back (0: the latest), or a forged one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Pick {
    Back(usize),
    Forged,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Fault {
    None,
    /// The call takes effect; its answer is lost.
    LostReply,
    /// The call is delayed past the caller's deadline: before it acts, or after.
    Timeout {
        acts: bool,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Step {
    Claim {
        key: usize,
        fp: u8,
        lease: Len,
        fault: Fault,
    },
    /// `n` claims of one key at once (long leases: exactly one may win).
    Race {
        key: usize,
        fp: u8,
        n: usize,
    },
    Extend {
        key: usize,
        token: Pick,
        lease: Len,
        fault: Fault,
    },
    Complete {
        key: usize,
        token: Pick,
        ttl: Len,
        fault: Fault,
    },
    Release {
        key: usize,
        token: Pick,
        fault: Fault,
    },
    Save {
        key: usize,
        token: Pick,
        fault: Fault,
    },
    Get {
        key: usize,
    },
    Recoverable,
    ForceRelease {
        key: usize,
        fault: Fault,
    },
    Delete {
        key: usize,
        fault: Fault,
    },
    /// Time passes: every short lease and TTL so far runs out.
    Pause,
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Fault::None => Ok(()),
            Fault::LostReply => f.write_str(" [reply lost]"),
            Fault::Timeout { acts: true } => f.write_str(" [timed out after it acted]"),
            Fault::Timeout { acts: false } => f.write_str(" [timed out before it acted]"),
        }
    }
}

impl fmt::Display for Pick {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Pick::Back(0) => f.write_str("its latest token"),
            Pick::Back(n) => write!(f, "the token {n} claim(s) back"),
            Pick::Forged => f.write_str("a forged token"),
        }
    }
}

impl fmt::Display for Len {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Len::Short => write!(f, "{SHORT:?}"),
            Len::Long => write!(f, "{LONG:?}"),
        }
    }
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Step::Claim {
                key,
                fp,
                lease,
                fault,
            } => write!(f, "claim k{key} with fp {fp}, lease {lease}{fault}"),
            Step::Race { key, fp, n } => {
                write!(
                    f,
                    "{n} concurrent claims of k{key} with fp {fp}, lease {LONG:?}"
                )
            }
            Step::Extend {
                key,
                token,
                lease,
                fault,
            } => write!(f, "extend k{key} with {token}, lease {lease}{fault}"),
            Step::Complete {
                key,
                token,
                ttl,
                fault,
            } => write!(f, "complete k{key} with {token}, ttl {ttl}{fault}"),
            Step::Release { key, token, fault } => write!(f, "release k{key} with {token}{fault}"),
            Step::Save { key, token, fault } => {
                write!(f, "save a recovery point on k{key} with {token}{fault}")
            }
            Step::Get { key } => write!(f, "get k{key}"),
            Step::Recoverable => f.write_str("recoverable"),
            Step::ForceRelease { key, fault } => write!(f, "force_release k{key}{fault}"),
            Step::Delete { key, fault } => write!(f, "delete k{key}{fault}"),
            Step::Pause => write!(f, "pause {PAUSE:?}: short leases and TTLs run out"),
        }
    }
}

/// splitmix64: small, seedable, and good enough to pick steps.
pub(super) struct Rng(u64);

impl Rng {
    pub(super) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    pub(super) fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    pub(super) fn chance(&mut self, percent: usize) -> bool {
        self.below(100) < percent
    }
}

/// The history generated from `seed`.
pub(super) fn generate(seed: u64, shape: Shape) -> Vec<Step> {
    let mut rng = Rng(seed);
    let keys = 2 + rng.below(2);
    let len = 6 + rng.below(shape.max_steps.saturating_sub(5).max(1));
    let mut steps = Vec::with_capacity(len);
    for _ in 0..len {
        // Most steps on the first key, so that its generations pile up.
        let key = if rng.chance(60) {
            0
        } else {
            1 + rng.below(keys - 1)
        };
        let fp = if rng.chance(85) { 0 } else { 1 };
        let lease = if rng.chance(65) {
            Len::Short
        } else {
            Len::Long
        };
        let fault = match rng.below(100) {
            0..=75 => Fault::None,
            76..=87 => Fault::LostReply,
            n => Fault::Timeout { acts: n % 2 == 0 },
        };
        let token = match rng.below(100) {
            0..=54 => Pick::Back(0),
            55..=69 => Pick::Back(1),
            70..=79 => Pick::Back(2),
            80..=89 => Pick::Back(3),
            _ => Pick::Forged,
        };
        let mut weights: Vec<(usize, u8)> = vec![
            (24, 0), // claim
            (14, 1), // pause
            (10, 2), // complete
            (9, 3),  // release
            (5, 4),  // extend
            (10, 5), // get
            (4, 6),  // race
        ];
        if shape.points {
            weights.push((8, 7)); // save
            weights.push((2, 8)); // recoverable
        }
        if shape.admin {
            weights.push((2, 9)); // force_release
            weights.push((2, 10)); // delete
        }
        let total: usize = weights.iter().map(|(w, _)| w).sum();
        let mut pick = rng.below(total);
        let mut kind = 0;
        for (w, k) in weights {
            if pick < w {
                kind = k;
                break;
            }
            pick -= w;
        }
        steps.push(match kind {
            0 => Step::Claim {
                key,
                fp,
                lease,
                fault,
            },
            1 => Step::Pause,
            2 => Step::Complete {
                key,
                token,
                ttl: if rng.chance(25) {
                    Len::Short
                } else {
                    Len::Long
                },
                fault,
            },
            3 => Step::Release { key, token, fault },
            4 => Step::Extend {
                key,
                token,
                lease,
                fault,
            },
            5 => Step::Get { key },
            6 => Step::Race {
                key,
                fp,
                n: 2 + rng.below(3),
            },
            7 => Step::Save { key, token, fault },
            8 => Step::Recoverable,
            9 => Step::ForceRelease { key, fault },
            _ => Step::Delete { key, fault },
        });
    }
    steps
}

// ------------------------------------------------------------------------------------------
// Faults
