"""Test helpers for object storage: a moto S3 server in a subprocess on 127.0.0.1 (killable and
restartable on the port it first bound) and a small fault-injecting HTTP proxy in front of it.

Everything listens on 127.0.0.1 only; every wait is bounded."""
import http.client, os, socket, struct, subprocess, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

HOST = '127.0.0.1'
KEYS = dict(AWS_ACCESS_KEY_ID='testing', AWS_SECRET_ACCESS_KEY='testing', AWS_DEFAULT_REGION='us-east-1',
            AWS_EC2_METADATA_DISABLED='true', AWS_CONFIG_FILE=os.devnull, AWS_SHARED_CREDENTIALS_FILE=os.devnull)


def wait_port(port, up=True, timeout=60.0):
    "Wait until a TCP connect to `port` succeeds (`up`) or is refused (not `up`); bounded by `timeout`."
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            with socket.create_connection((HOST, port), timeout=1): ok = True
        except OSError: ok = False
        if ok == up: return
        time.sleep(0.05)
    raise TimeoutError(f"port {port} still {'down' if up else 'up'} after {timeout}s")


def until(cond, timeout=60.0, what='condition'):
    "Wait until `cond()` is true, polling; an AssertionError naming `what` after `timeout` seconds."
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond(): return
        time.sleep(0.02)
    raise AssertionError(f"{what} not reached in {timeout}s")


def s3_env(endpoint) -> dict:
    "Environment for a client of the S3 server at `endpoint` (fixed test keys; no config files, no metadata service)."
    return dict(KEYS, AWS_ENDPOINT_URL=endpoint)


_MOTO = ("import sys, threading; from moto.server import ThreadedMotoServer; "
         "s = ThreadedMotoServer(ip_address=sys.argv[1], port=int(sys.argv[2]), verbose=False); s.start(); "
         "print(s.get_host_and_port()[1], flush=True); threading.Event().wait()")


class MotoServer:
    "moto's S3 server as a child process on 127.0.0.1; the first `start()` binds a free port (moto itself, so no other process can take it meanwhile), `kill()` is SIGKILL, `start()` again reuses the port (moto keeps no data across it)."
    def __init__(self, port=None): self.port, self.proc = port, None
    @property
    def endpoint(self): return f'http://{HOST}:{self.port}'
    def start(self):
        import select
        assert self.proc is None
        self.proc = subprocess.Popen([sys.executable, '-c', _MOTO, HOST, str(self.port or 0)], stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True, env=dict(os.environ, **KEYS))
        ready = select.select([self.proc.stdout], [], [], 120)[0]
        line = self.proc.stdout.readline().strip() if ready else ''
        if not line.isdigit(): self.kill(); raise TimeoutError(f"moto's server did not start in 120 s (printed {line!r})")
        self.port = int(line)
        wait_port(self.port, True)
        return self
    def kill(self):
        if self.proc is None: return
        self.proc.kill(); self.proc.wait(timeout=30); self.proc.stdout.close(); self.proc = None
        if self.port: wait_port(self.port, False, timeout=30)
    def client(self):
        import boto3
        return boto3.client('s3', endpoint_url=self.endpoint, region_name='us-east-1',
                            aws_access_key_id='testing', aws_secret_access_key='testing')
    def put(self, bucket, objects: dict):
        "Create `bucket` (if missing) and upload `{key: bytes}`, straight to moto (not through any proxy)."
        c = self.client()
        if bucket not in [b['Name'] for b in c.list_buckets().get('Buckets', [])]: c.create_bucket(Bucket=bucket)
        for k, v in objects.items(): c.put_object(Bucket=bucket, Key=k, Body=v)
    def __enter__(self): return self.start()
    def __exit__(self, *exc): self.kill()


def _read_chunked(f) -> bytes:
    "A request body sent with `Transfer-Encoding: chunked` (as the AWS SDK uploads parts), de-framed; forwarded with a Content-Length."
    out = bytearray()
    while True:
        n = int(f.readline().split(b';')[0].strip() or b'0', 16)
        if n == 0: break
        out += f.read(n); f.readline()
    while f.readline() not in (b'\r\n', b'\n', b''): pass          # trailers, then the blank line
    return bytes(out)


_HOP = {'expect', 'connection', 'keep-alive', 'proxy-authenticate', 'proxy-authorization', 'te', 'trailers', 'transfer-encoding', 'upgrade'}
ERRORS = {503: ('SlowDown', 'Please reduce your request rate.'), 500: ('InternalError', 'We encountered an internal error.'),
          403: ('AccessDenied', 'Access Denied'), 404: ('NoSuchKey', 'The specified key does not exist.')}


def error_body(status) -> bytes:
    code, msg = ERRORS.get(status, ('InternalError', 'error'))
    return f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{msg}</Message></Error>'.encode()


class _Server(ThreadingHTTPServer):
    "Closes a connection marked for reset without the polite shutdown(SHUT_WR) first, so SO_LINGER 0 sends a RST."
    daemon_threads = True
    def __init__(self, *a):
        super().__init__(*a); self.to_reset = set()
    def shutdown_request(self, request):
        if id(request) in self.to_reset: self.to_reset.discard(id(request)); request.close()
        else: super().shutdown_request(request)


class Fault:
    "What to do to `count` requests whose method is `method` and whose path contains `path`, after `skip` of them."
    def __init__(self, kind, path='', count=1, method='GET', after=0, status=503, skip=0):
        assert kind in ('status', 'reset', 'truncate', 'stall', 'corrupt'), kind
        self.kind, self.path, self.count, self.method, self.after, self.status = kind, path, count, method, after, status
        self.skip = skip     # matching requests to let through untouched first


class FaultProxy:
    """An HTTP/1.1 proxy on 127.0.0.1 in front of `backend_port`, applying queued `Fault`s:
    `status` answers `status` (503 SlowDown by default; 500, 403, 404 with their S3 error codes) without asking the backend; `reset` sends the
    headers and `after` body bytes, then a TCP reset; `truncate` the same, then a clean close;
    `stall` the same, then waits (until `release()` or `stall_max` seconds) before closing; `corrupt`
    flips one byte of the body. While `down` is set, or when the backend refuses connections, the proxy
    resets every client connection, as a dead server would."""
    def __init__(self, backend_port, stall_max=60.0):
        self.backend_port, self.stall_max, self.down = backend_port, stall_max, False
        self.faults, self.log, self.lock, self.released = [], [], threading.Lock(), threading.Event()
        proxy = self
        class Handler(BaseHTTPRequestHandler):
            protocol_version = 'HTTP/1.1'
            def log_message(self, *a): pass
            def do_GET(self): proxy._handle(self)
            do_HEAD = do_PUT = do_POST = do_DELETE = do_GET
        self.server = _Server((HOST, 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
    @property
    def endpoint(self): return f'http://{HOST}:{self.port}'
    def add(self, *a, **kw) -> Fault:
        f = Fault(*a, **kw)
        with self.lock: self.faults.append(f)
        return f
    def release(self): self.released.set()
    def requests(self, path='', method='GET'):
        "The faults applied (None when forwarded untouched) to requests with `method` whose path contains `path`."
        with self.lock: return [k for m, p, k, r in self.log if m == method and path in p]
    def ranges(self, path='', method='GET'):
        "The Range headers (None when absent) of requests with `method` whose path contains `path`."
        with self.lock: return [r for m, p, k, r in self.log if m == method and path in p]
    def _take(self, method, path, rng):
        with self.lock:
            f = next((f for f in self.faults if f.method == method and f.path in path and f.count > 0), None)
            if f is not None and f.skip > 0: f.skip -= 1; f = None
            elif f is not None:
                f.count -= 1
                if f.count == 0: self.faults.remove(f)
            self.log.append((method, path, f and f.kind, rng))
            return f
    def _handle(self, h):
        n = int(h.headers.get('Content-Length') or 0)
        body = _read_chunked(h.rfile) if 'chunked' in (h.headers.get('Transfer-Encoding') or '').lower() else h.rfile.read(n) if n else b''
        if self.down:                                       # the store is gone: every request is reset
            with self.lock: self.log.append((h.command, h.path, 'down', h.headers.get('Range')))
            self._reset(h); return
        f = self._take(h.command, h.path, h.headers.get('Range'))
        if f is not None and f.kind == 'status':
            body = error_body(f.status)
            h.send_response(f.status); h.send_header('Content-Type', 'application/xml')
            h.send_header('Content-Length', str(len(body))); h.end_headers()
            if h.command != 'HEAD': h.wfile.write(body)
            return
        try:
            c = http.client.HTTPConnection(HOST, self.backend_port, timeout=30)
            c.request(h.command, h.path, body=body, headers={k: v for k, v in h.headers.items() if k.lower() not in _HOP})
            r = c.getresponse(); data = r.read(); c.close()
        except OSError:                                     # the backend is down: so are we, as far as the client sees
            self._reset(h); return
        h.send_response(r.status)
        for k, v in r.getheaders():
            if k.lower() not in _HOP and k.lower() != 'content-length': h.send_header(k, v)
        h.send_header('Content-Length', r.getheader('Content-Length', '0') if h.command == 'HEAD' else str(len(data)))
        h.end_headers()
        if h.command == 'HEAD': return
        if f is None: h.wfile.write(data); return
        if f.kind == 'corrupt':
            i = len(data) // 2
            h.wfile.write(data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1:]); return
        h.wfile.write(data[:f.after]); h.wfile.flush()
        if f.kind == 'stall': self.released.wait(self.stall_max)
        if f.kind == 'reset': self._reset(h)
        else: h.close_connection = True
    def _reset(self, h):
        h.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack('ii', 1, 0))
        self.server.to_reset.add(id(h.connection)); h.close_connection = True
    def start(self): self.thread.start(); return self
    def stop(self):
        self.released.set(); self.server.shutdown(); self.server.server_close()
    def __enter__(self): return self.start()
    def __exit__(self, *exc): self.stop()


# The fixtures both S3 test files use: import them into a test module (`from s3util import moto, proxy`).
import pytest, re

@pytest.fixture(scope='module')
def moto():
    "One moto server on 127.0.0.1 for the module."
    with MotoServer() as m: yield m


@pytest.fixture
def proxy(moto):
    "A fault-injecting proxy in front of it, per test."
    with FaultProxy(moto.port) as px: yield px


def use_proxy(proxy, monkeypatch, request) -> str:
    "Point the AWS environment at `proxy`; return a bucket name of the test's own."
    for k, v in s3_env(proxy.endpoint).items(): monkeypatch.setenv(k, v)
    monkeypatch.delenv('AWS_ENDPOINT_URL_S3', raising=False)
    return 'b-' + re.sub(r'[^a-z0-9]+', '-', request.node.name.lower())[:50].strip('-')
