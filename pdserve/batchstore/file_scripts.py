"""The Lua scripts :class:`~pdserve.batchstore.files.FileStore` runs in Redis, where a file's
metadata, content and readers must change together: hold a file for a batch (and extend its expiry),
publish a stored file's content with its metadata at once, and delete a file no batch reads.
"""

from __future__ import annotations

# KEYS[1] metadata, KEYS[2] content (absent with --files-dir), KEYS[3] the set of batches reading it;
# ARGV[1] batch id, ARGV[2] keep for at least this many ms, ARGV[3] the expiry that makes (unix s).
# Returns the metadata, or nil when there is no file.
_HOLD = """
local raw = redis.call('GET', KEYS[1])
if not raw then return nil end
redis.call('SADD', KEYS[3], ARGV[1])
local want = tonumber(ARGV[2])
local ttl = redis.call('PTTL', KEYS[1])
if ttl >= 0 and ttl < want then
  local info = cjson.decode(raw)
  info.expires_at = tonumber(ARGV[3])
  raw = cjson.encode(info)
  redis.call('SET', KEYS[1], raw, 'PX', want)
  if redis.call('EXISTS', KEYS[2]) == 1 then redis.call('PEXPIRE', KEYS[2], want) end
  ttl = want
end
if ttl >= 0 then redis.call('PEXPIRE', KEYS[3], ttl) end
return raw
"""


# KEYS[1] the partial content, KEYS[2] the content, KEYS[3] the metadata; ARGV[1] the metadata,
# ARGV[2] the TTL in ms, ARGV[3] the size the file has. The stored pieces become the file's content,
# and its metadata appears, at once. Returns -1 (also when the file was published already: a batch's
# output, published by two finalizations); or, when the partial content is not ARGV[3] bytes (a piece
# was lost: the partial key expired or was deleted meanwhile), deletes it and returns its size.
_PUBLISH = """
if redis.call('EXISTS', KEYS[3]) == 1 then return -1 end
local size = redis.call('STRLEN', KEYS[1])
if size ~= tonumber(ARGV[3]) then
  redis.call('DEL', KEYS[1])
  return size
end
if size > 0 then
  redis.call('RENAME', KEYS[1], KEYS[2])
  redis.call('PEXPIRE', KEYS[2], ARGV[2])
else
  redis.call('SET', KEYS[2], '', 'PX', ARGV[2])
end
redis.call('SET', KEYS[3], ARGV[1], 'PX', ARGV[2])
return -1
"""


# KEYS as _HOLD's. Deletes the file unless some batch reads it: -1 then, else 1 (0: no file).
_DELETE = """
if redis.call('SCARD', KEYS[3]) > 0 then return -1 end
local existed = redis.call('DEL', KEYS[1])
redis.call('DEL', KEYS[2])
return existed
"""
