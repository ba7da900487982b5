"""Redis time per store operation: the hash-based store (commit 5ee8daf), the script protocol
(claim.lua pipelined with a GET, as of commit 3ba9ee8) and the plain protocol this store sends
on Redis 7 without quotas (the claim one `SET … NX PX … GET`, and a `PTTL` after it when it
finds a record in progress).

Run from the repository, against a PRIVATE Redis (it resets INFO commandstats):

    redis-server --port 6391 --save "" --appendonly no --daemonize yes
    python3 benches/redis_server_cost.py 6391 20000 70        # 20,000 of each, 70-byte body
    python3 benches/redis_server_cost.py 6391 300 1048576     # 1 MiB body

Sends over a raw socket the exact commands each version of the store sends: N claims of new
keys, N completes (an answer of the body plus 60 bytes of status and headers), N replays, N
claims of records in progress (conflict), and for the plain protocol N takeovers of lapsed
leases (its plain claim and `PTTL`, then the script). Prints Redis's microseconds per operation: the sum
over the commands the store sends (EVALSHA, GET, SET, PTTL), which includes what the scripts
ran inside. Not a wall-clock figure, so other load on the machine moves it far less than
throughput. ROUNDS (the fifth argument, default 3) repeats every version in turn; the
figure printed last is each one's median.
"""
import subprocess
import os, socket, sys, time

PORT = int(sys.argv[1]); N = int(sys.argv[2]); BODY = int(sys.argv[3]) if len(sys.argv) > 3 else 70
NEW = 'src/store/redis/lua'
SCRIPT_REV = sys.argv[4] if len(sys.argv) > 4 else '3ba9ee8'
ROUNDS = int(sys.argv[5]) if len(sys.argv) > 5 else 3

def enc(*args):
    out = [b'*%d\r\n' % len(args)]
    for a in args:
        if isinstance(a, str): a = a.encode()
        if isinstance(a, int): a = str(a).encode()
        out.append(b'$%d\r\n%s\r\n' % (len(a), a))
    return b''.join(out)

class Conn:
    def __init__(self):
        self.s = socket.create_connection(('127.0.0.1', PORT)); self.buf = b''
    def line(self):
        while b'\r\n' not in self.buf: self.buf += self.s.recv(1 << 20)
        l, self.buf = self.buf.split(b'\r\n', 1); return l
    def read(self):
        l = self.line(); t = l[:1]
        if t in (b'+', b':'): return l[1:]
        if t == b'-': return Exception(l[1:].decode())
        if t == b'$':
            n = int(l[1:])
            if n < 0: return None
            while len(self.buf) < n + 2: self.buf += self.s.recv(1 << 20)
            v, self.buf = self.buf[:n], self.buf[n+2:]; return v
        if t == b'*':
            n = int(l[1:]); return None if n < 0 else [self.read() for _ in range(n)]
        raise ValueError(l)
    def many(self, cmds):
        self.s.sendall(b''.join(cmds)); return [self.read() for _ in cmds]
    def one(self, *a): return self.many([enc(*a)])[0]

def stats(c):
    info = c.one('INFO', 'commandstats').decode()
    out = {}
    for l in info.splitlines():
        if l.startswith('cmdstat_'):
            name, rest = l[8:].split(':', 1)
            f = dict(kv.split('=') for kv in rest.split(','))
            out[name] = (int(f['calls']), int(f['usec']))
    return out

RESULTS = {}

def cost(c, label, run, n, sent):
    """Runs `run`, then prints and keeps Redis's usec per op over the `sent` commands."""
    c.one('CONFIG', 'RESETSTAT')
    run()
    st = stats(c)
    usec = sum(st.get(k, (0, 0))[1] for k in sent)
    detail = ', '.join('%s %d calls %.2f us' % (k, v[0], v[1] / v[0]) for k, v in sorted(st.items()) if k not in ('config|resetstat', 'info'))
    print('%-32s %6.2f us per op   [%s]' % (label, usec / n, detail))
    RESULTS.setdefault(label, []).append(usec / n)
    return usec / n

import re
old_src = subprocess.run(['git', 'show', '5ee8daf:src/store/redis.rs'], capture_output=True, check=True, text=True).stdout
def const(name):
    return re.search(r'const ' + name + r': &str = r"\n(.*?)\n";', old_src, re.S).group(1) + '\n'
def at_rev(path):
    return subprocess.run(['git', 'show', '%s:%s' % (SCRIPT_REV, path)], capture_output=True, check=True, text=True).stdout
c = Conn()
old = {k: c.one('SCRIPT', 'LOAD', v).decode() for k, v in {
    'claim': const('PRELUDE') + const('CLAIM'),
    'complete': const('PRELUDE') + const('FENCE') + const('COMPLETE')}.items()}
script = {k: c.one('SCRIPT', 'LOAD', at_rev('src/store/redis/lua/%s.lua' % k)).decode() for k in ('claim', 'complete')}
new = {k: c.one('SCRIPT', 'LOAD', open(os.path.join(NEW, k + '.lua')).read()).decode() for k in ('claim', 'complete')}
answer = os.urandom(BODY + 60)  # an encoded completion: status, two headers, the body
tag = '%d-%d' % (os.getpid(), time.time_ns())
fp = b'F' * 32
LEASE, KEEP = 30000, 86400000
GAP = b'k%015d' % (KEEP - LEASE)
ID = 'ab' * 32

def batches(cmds, size=500):
    out = []
    for i in range(0, len(cmds), size): out += c.many(cmds[i:i+size])
    return out

def header(n):
    return b'2p' + fp + n + b'0000000000000001'

def run(version, rnd):
    keys = ['ops:%s:%s:%d:{%064d}' % (tag, version, rnd, i) for i in range(N)]
    nonces = [os.urandom(8).hex().encode() for _ in range(N)]
    if version == 'hash':
        claim = lambda k, n: [enc('EVALSHA', old['claim'], 1, k, fp, n, LEASE, KEEP, '1')]
        complete = lambda k, n: [enc('EVALSHA', old['complete'], 1, k, '1', n, answer, KEEP)]
        sent = ('evalsha', 'get')
    elif version == 'script':
        claim = lambda k, n: [enc('EVALSHA', script['claim'], 1, k, header(n), LEASE, KEEP), enc('GET', k)]
        complete = lambda k, n: [enc('EVALSHA', script['complete'], 1, k, n + b'0000000000000001', answer, KEEP, ID)]
        sent = ('evalsha', 'get')
    else:
        # The plain protocol: the record, its lease a gap before the key's expiry.
        # A record in progress (a conflict, a takeover) costs the PTTL too, sent after it.
        claim = lambda k, n: [enc('SET', k, header(n) + GAP, 'NX', 'PX', KEEP, 'GET')]
        held = lambda k, n: claim(k, n) + [enc('PTTL', k)]
        complete = lambda k, n: [enc('EVALSHA', new['complete'], 1, k, n + b'0000000000000001', answer, KEEP, ID)]
        sent = ('set', 'pttl')
    if version != 'plain':
        held = claim
    label = lambda what: '%s %s' % (version, what)
    total = cost(c, label('claim, new key'), lambda: batches([x for k, n in zip(keys, nonces) for x in claim(k, n)]), N, sent)
    total += cost(c, label('complete'), lambda: batches([x for k, n in zip(keys, nonces) for x in complete(k, n)]), N, ('evalsha',))
    RESULTS.setdefault(label('new key (claim + complete)'), []).append(total)
    other = os.urandom(8).hex().encode()
    cost(c, label('claim, replay'), lambda: batches([x for k in keys for x in claim(k, other)]), N, sent)
    busy = ['ops:%s:%s:%d:busy:{%064d}' % (tag, version, rnd, i) for i in range(N)]
    batches([x for k in busy for x in claim(k, b'x' * 16)])
    cost(c, label('claim, conflict'), lambda: batches([x for k in busy for x in held(k, other)]), N, sent)
    if version == 'plain':
        # Lapse every lease (an expiry closer than the gap), then take over as the store
        # does: its plain claim reads the lapsed record, the script (with a GET) takes over.
        batches([enc('PEXPIRE', k, KEEP - LEASE - 1000) for k in busy])
        again = os.urandom(8).hex().encode()
        t = cost(c, label('takeover: plain claim'), lambda: batches([x for k in busy for x in held(k, again)]), N, sent)
        t += cost(c, label('takeover: script'), lambda: batches([x for k in busy for x in (
            enc('EVALSHA', new['claim'], 1, k, header(again), LEASE, KEEP), enc('GET', k))]), N, ('evalsha', 'get'))
        RESULTS.setdefault(label('takeover (both)'), []).append(t)
    batches([enc('DEL', k) for k in keys + busy])

for rnd in range(ROUNDS):
    for version in ('hash', 'script', 'plain'):
        run(version, rnd)
    print()

print('median of %d rounds, Redis usec per operation (N=%d, body %d bytes):' % (ROUNDS, N, BODY))
for label, xs in RESULTS.items():
    print('  %-40s %6.2f' % (label, sorted(xs)[len(xs) // 2]))
