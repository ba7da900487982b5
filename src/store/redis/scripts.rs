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

    /// `EVALSHA` of this script on `keys` with `args`.
    pub(super) fn call<'a>(
        &self,
        keys: &[&str],
        args: impl IntoIterator<Item = &'a [u8]>,
    ) -> redis::Cmd {
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(self.script.get_hash()).arg(keys.len()).arg(keys);
        for a in args {
            cmd.arg(a);
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
