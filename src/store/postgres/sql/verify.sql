-- Every column the store uses, readable by this role.
SELECT id, fingerprint, state, generation, nonce, locked_until, status, headers, body,
       trailers, created_at, expires_at, scope, recovery_point
  FROM {table}
 LIMIT 0
