// The Idempotency-Key as nginx's access log records it: its SHA-256 (hex),
// never the key itself. Loaded by compose/nginx.conf and devtools/nginx.py
// (njs, nginx's JavaScript module); devtools/soak.py hashes its keys the
// same way to find them in the log. An operator finds a logged key with
// `printf %s "$KEY" | sha256sum`.
import crypto from 'crypto';

function digest(r) {
    var key = r.headersIn['Idempotency-Key'];
    return key ? crypto.createHash('sha256').update(key).digest('hex') : '-';
}

export default {digest};
