//! The Lua scripts, each in its own `.lua` file beside this one.
//!
//! They run as `EVALSHA`. A `FUNCTION` library would survive a failover without a
//! `NOSCRIPT` round trip, but it needs Redis 7, a library name shared by every deployed
//! version of this crate, and the right to `FUNCTION LOAD`; and a function without the
//! `allow-oom` flag is refused outright by a full Redis, where a plain script still reads.
//! A `NOSCRIPT` answer costs one extra round trip, once per node and script: the store loads
//! the script there and sends the call again.

use redis::Script;

/// A script and its code (for `SCRIPT LOAD`, which [`Script`] does not expose).
#[derive(Debug)]
pub(super) struct Lua {
    pub(super) code: &'static str,
    pub(super) script: Script,
}

impl Lua {
    fn new(code: &'static str) -> Self {
        Self {
            code,
            script: Script::new(code),
        }
    }

    /// `EVALSHA` of this script on `keys` with `args`, built in buffers of the exact size
    /// (growing them argument by argument was a dozen reallocations per call).
    pub(super) fn call(&self, keys: &[&str], args: &[&[u8]]) -> redis::Cmd {
        let hash = self.script.get_hash();
        // A record's key alone, or with its scope group's two: one digit.
        assert!(keys.len() < 10, "a script call names at most nine keys");
        let count = [b'0' + keys.len() as u8];
        let data = "EVALSHA".len()
            + hash.len()
            + count.len()
            + keys.iter().map(|k| k.len()).sum::<usize>()
            + args.iter().map(|a| a.len()).sum::<usize>();
        let mut cmd = redis::Cmd::with_capacity(3 + keys.len() + args.len(), data);
        cmd.arg("EVALSHA").arg(hash).arg(&count[..]);
        for k in keys {
            cmd.arg(*k);
        }
        for a in args {
            cmd.arg(*a);
        }
        cmd
    }
}

#[derive(Debug)]
pub(super) struct Scripts {
    pub(super) claim: Lua,
    pub(super) extend: Lua,
    pub(super) complete: Lua,
    pub(super) release: Lua,
    pub(super) remove: Lua,
    pub(super) save: Lua,
    pub(super) index: Lua,
}

impl Scripts {
    pub(super) fn new() -> Self {
        Self {
            claim: Lua::new(include_str!("lua/claim.lua")),
            extend: Lua::new(include_str!("lua/extend.lua")),
            complete: Lua::new(include_str!("lua/complete.lua")),
            release: Lua::new(include_str!("lua/release.lua")),
            remove: Lua::new(include_str!("lua/remove.lua")),
            save: Lua::new(include_str!("lua/save.lua")),
            index: Lua::new(include_str!("lua/index.lua")),
        }
    }

    pub(super) fn all(&self) -> [&Lua; 7] {
        [
            &self.claim,
            &self.extend,
            &self.complete,
            &self.release,
            &self.remove,
            &self.save,
            &self.index,
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_call_is_the_evalsha_that_redis_rs_would_build_argument_by_argument() {
        let lua = Scripts::new().complete;
        let args: [&[u8]; 4] = [b"", b"\x00\xff binary", b"30000", &[7; 300]];
        for keys in [&["k{1}"][..], &["k{1}", "g{1}s", "g{1}b"][..]] {
            let mut expected = redis::cmd("EVALSHA");
            expected
                .arg(lua.script.get_hash())
                .arg(keys.len())
                .arg(keys);
            for a in args {
                expected.arg(a);
            }
            assert_eq!(
                lua.call(keys, &args).get_packed_command(),
                expected.get_packed_command()
            );
        }
    }
}
