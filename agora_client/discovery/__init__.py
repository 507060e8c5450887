"""Discovery: how peers find each other and what they may say in the DHT.

- ``seed``: the `agora seed` role, a stateless DHT bootstrap peer;
- ``dht``: joining the swarm's DHT from whichever seed answers;
- ``roster``: the DHT key schema of the worker roster that workers publish and trainers read;
- ``signed_records``: the DHT keys and schemas of the records workers and trainers sign (metrics, verdicts);
- ``progress_records``: the DHT key and schema of the trainers' progress (loss, eval loss) and its read;
- ``replica_drift``: a stage's replica drift, from its workers' metrics records;
- ``validators``: the record validators every DHT node runs, seeds included.

``agora_client.swarm`` keeps only the local multi-process launcher built on top of this.
"""
