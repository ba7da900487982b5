"""Redis time per store operation, the hash-based store (commit 5ee8daf) against this one.

Run from the repository, against a PRIVATE Redis (it resets INFO commandstats):

    redis-server --port 6391 --save "" --appendonly no --daemonize yes
    python3 benches/redis_server_cost.py 6391 20000 70        # 20,000 of each, 70-byte body
    python3 benches/redis_server_cost.py 6391 300 1048576     # 1 MiB body

Sends over a raw socket the exact commands each version of the store sends: N claims of new
keys, N completes (an answer of the body plus 60 bytes of status and headers), N replays, N
claims of records in progress (conflict). Prints Redis's microseconds per operation: the sum
over the commands the store sends (EVALSHA, GET), which includes what the scripts ran inside.
Not a wall-clock figure, so other load on the machine moves it far less than throughput.
"""
import subprocess
import os, socket, sys, time

PORT = int(sys.argv[1]); N = int(sys.argv[2]); BODY = int(sys.argv[3]) if len(sys.argv) > 3 else 70
NEW = sys.argv[4] if len(sys.argv) > 4 else 'src/store/redis/lua'

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

def cost(c, label, run, n):
    c.one('CONFIG', 'RESETSTAT')
    run()
    st = stats(c)
    usec = sum(st.get(k, (0, 0))[1] for k in ('evalsha', 'get'))
    detail = ', '.join('%s %d calls %.2f us' % (k, v[0], v[1] / v[0]) for k, v in sorted(st.items()) if k not in ('config|resetstat', 'info'))
    print('%-28s %6.2f us per op   [%s]' % (label, usec / n, detail))

import re
old_src = subprocess.run(['git', 'show', '5ee8daf:src/store/redis.rs'], capture_output=True, check=True, text=True).stdout
def const(name):
    return re.search(r'const ' + name + r': &str = r"\n(.*?)\n";', old_src, re.S).group(1) + '\n'
c = Conn()
old = {k: c.one('SCRIPT', 'LOAD', v).decode() for k, v in {
    'claim': const('PRELUDE') + const('CLAIM'),
    'complete': const('PRELUDE') + const('FENCE') + const('COMPLETE')}.items()}
new = {k: c.one('SCRIPT', 'LOAD', open(os.path.join(NEW, k + '.lua')).read()).decode() for k in ('claim', 'complete')}
answer = os.urandom(BODY + 60)  # an encoded completion: status, two headers, the body
tag = '%d-%d' % (os.getpid(), time.time_ns())
fp = b'F' * 32

def batches(cmds, size=500):
    out = []
    for i in range(0, len(cmds), size): out += c.many(cmds[i:i+size])
    return out

for version in ('old', 'new'):
    keys = ['ops:%s:%s:{%064d}' % (tag, version, i) for i in range(N)]
    nonces = [os.urandom(8).hex().encode() for _ in range(N)]
    if version == 'old':
        claim = lambda k, n: [enc('EVALSHA', old['claim'], 1, k, fp, n, 30000, 86400000, '1')]
        def complete(k, n): return [enc('EVALSHA', old['complete'], 1, k, '1', n, answer, 86400000)]
    else:
        claim = lambda k, n: [enc('EVALSHA', new['claim'], 1, k, b'2p' + fp + n + b'0000000000000001', 30000, 86400000), enc('GET', k)]
        def complete(k, n):
            return [enc('EVALSHA', new['complete'], 1, k, n + b'0000000000000001', answer, 86400000, 'ops:')]
    cost(c, version + ' claim, new key', lambda: batches([x for k, n in zip(keys, nonces) for x in claim(k, n)]), N)
    cost(c, version + ' complete', lambda: batches([x for k, n in zip(keys, nonces) for x in complete(k, n)]), N)
    other = os.urandom(8).hex().encode()
    cost(c, version + ' claim, replay', lambda: batches([x for k in keys for x in claim(k, other)]), N)
    busy = ['ops:%s:%s:busy:{%064d}' % (tag, version, i) for i in range(N)]
    batches([x for k in busy for x in claim(k, b'x' * 16)])
    cost(c, version + ' claim, conflict', lambda: batches([x for k in busy for x in claim(k, other)]), N)
    batches([enc('DEL', k) for k in keys + busy])
