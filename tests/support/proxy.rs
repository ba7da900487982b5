//! A TCP fault proxy between a store client and a real Redis or Postgres. Each direction
//! passes, delays or blackholes bytes; the next reply can be lost with its connection cut;
//! connections can be reset (RST) and new ones refused. `heal` undoes it all.
#![allow(dead_code, unreachable_pub)]

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// What one direction does with the bytes it reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Pass,
    /// Holds each chunk this long before passing it on (order kept).
    Delay(Duration),
    /// Holds every byte while set; the connection stays open and silent. The bytes arrive
    /// once the direction passes again, as TCP retransmits them after a partition heals.
    Blackhole,
    /// Swallows the next chunk, then cuts that connection: a reply lost with its link.
    LoseNextThenCut,
}

/// Client to server, or server to client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dir {
    Up,
    Down,
}

#[derive(Debug)]
struct State {
    up: Mutex<Mode>,
    down: Mutex<Mode>,
    refuse: AtomicBool,
    /// Bumped by `reset`: every connection open at that moment is reset.
    resets: watch::Sender<u64>,
    /// Faults applied: chunks delayed, swallowed or lost, connections reset or refused.
    faults: AtomicU64,
}

#[derive(Debug)]
pub struct FaultProxy {
    pub port: u16,
    state: Arc<State>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.task.abort();
        self.reset();
    }
}

impl FaultProxy {
    /// Listens on a free loopback port and relays to `upstream` (`host:port`).
    pub async fn start(upstream: &str) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let state = Arc::new(State {
            up: Mutex::new(Mode::Pass),
            down: Mutex::new(Mode::Pass),
            refuse: AtomicBool::new(false),
            resets: watch::channel(0).0,
            faults: AtomicU64::new(0),
        });
        let upstream = upstream.to_owned();
        let task = {
            let state = state.clone();
            tokio::spawn(async move {
                while let Ok((client, _)) = listener.accept().await {
                    if state.refuse.load(Ordering::SeqCst) {
                        state.faults.fetch_add(1, Ordering::SeqCst);
                        reset_now(client);
                        continue;
                    }
                    let (state, upstream) = (state.clone(), upstream.clone());
                    tokio::spawn(async move {
                        let Ok(server) = TcpStream::connect(&upstream).await else {
                            return;
                        };
                        connection(client, server, state).await;
                    });
                }
            })
        };
        Self { port, state, task }
    }

    pub fn set(&self, dir: Dir, mode: Mode) {
        *self.slot(dir).lock().unwrap() = mode;
    }

    fn slot(&self, dir: Dir) -> &Mutex<Mode> {
        slot_of(&self.state, dir)
    }

    /// Resets (RST) every open connection.
    pub fn reset(&self) {
        self.state.resets.send_modify(|n| *n += 1);
    }

    /// Refuses (resets at once) every new connection while `on`.
    pub fn refuse(&self, on: bool) {
        self.state.refuse.store(on, Ordering::SeqCst);
    }

    /// Both directions pass and new connections are accepted again.
    pub fn heal(&self) {
        self.set(Dir::Up, Mode::Pass);
        self.set(Dir::Down, Mode::Pass);
        self.refuse(false);
    }

    /// Faults injected so far.
    pub fn faults(&self) -> u64 {
        self.state.faults.load(Ordering::SeqCst)
    }
}

fn reset_now(stream: TcpStream) {
    // Linger 0 makes the close an RST rather than a FIN.
    let _ = socket_linger_zero(&stream);
    drop(stream);
}

#[allow(deprecated)]
fn socket_linger_zero(stream: &TcpStream) -> std::io::Result<()> {
    stream.set_linger(Some(Duration::ZERO))
}

async fn connection(client: TcpStream, server: TcpStream, state: Arc<State>) {
    let _ = socket_linger_zero(&client);
    let _ = socket_linger_zero(&server);
    let mut resets = state.resets.subscribe();
    let born = *resets.borrow_and_update();
    let (cr, cw) = client.into_split();
    let (sr, sw) = server.into_split();
    tokio::select! {
        biased;
        _ = resets.changed() => { state.faults.fetch_add(1, Ordering::SeqCst); }
        _ = pump(cr, sw, state.clone(), Dir::Up, born) => {}
        _ = pump(sr, cw, state.clone(), Dir::Down, born) => {}
    }
    // Dropping both halves of both streams closes them with RST (linger 0).
}

/// Relays one direction until either side closes or a fault cuts it.
/// `born` is the reset count when the connection opened: once `reset` has bumped it, no
/// further byte is relayed, even one read before the connection task saw the reset.
async fn pump(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    state: Arc<State>,
    dir: Dir,
    born: u64,
) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        let mode = {
            let mut slot = slot_of(&state, dir).lock().unwrap();
            let mode = *slot;
            if mode == Mode::LoseNextThenCut {
                *slot = Mode::Pass;
            }
            mode
        };
        match mode {
            Mode::Pass => {}
            Mode::Delay(d) => {
                state.faults.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(d).await;
            }
            Mode::Blackhole => {
                state.faults.fetch_add(1, Ordering::SeqCst);
                while *slot_of(&state, dir).lock().unwrap() == Mode::Blackhole {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
            Mode::LoseNextThenCut => {
                state.faults.fetch_add(1, Ordering::SeqCst);
                return;
            }
        }
        if *state.resets.borrow() != born {
            return;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

fn slot_of(state: &State, dir: Dir) -> &Mutex<Mode> {
    match dir {
        Dir::Up => &state.up,
        Dir::Down => &state.down,
    }
}
