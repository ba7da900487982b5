use super::*;

#[test]
fn histories_are_generated_from_their_seed() {
    let shape = Shape {
        points: true,
        admin: true,
        max_steps: 24,
    };
    assert_eq!(generate(42, shape), generate(42, shape));
    assert_ne!(generate(42, shape), generate(43, shape));
    let all: Vec<Step> = (0..200).flat_map(|s| generate(s, shape)).collect();
    for want in [
        |s: &Step| {
            matches!(
                s,
                Step::Complete {
                    token: Pick::Back(3),
                    ..
                }
            )
        },
        |s: &Step| {
            matches!(
                s,
                Step::Claim {
                    fault: Fault::LostReply,
                    ..
                }
            )
        },
        |s: &Step| {
            matches!(
                s,
                Step::Release {
                    fault: Fault::Timeout { acts: true },
                    ..
                }
            )
        },
        |s: &Step| {
            matches!(
                s,
                Step::Save {
                    fault: Fault::Timeout { acts: false },
                    ..
                }
            )
        },
        |s: &Step| matches!(s, Step::Race { .. }),
        |s: &Step| matches!(s, Step::ForceRelease { .. }),
    ] {
        assert!(all.iter().any(want));
    }
}

#[test]
fn every_order_of_four_claims() {
    let p = permutations(4);
    assert_eq!(p.len(), 24);
    let mut q = p.clone();
    q.sort();
    q.dedup();
    assert_eq!(q.len(), 24);
}
