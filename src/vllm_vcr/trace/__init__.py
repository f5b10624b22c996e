"""The trace library: the schema, reading and writing trace files, statistics, block hashes and
client-side stream timing. A leaf: used by record/, replay/ and inspect/; imports none of them."""
