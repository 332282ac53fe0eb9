"""The write side: log transports (Kafka, local SQLite log) and the record producer."""
