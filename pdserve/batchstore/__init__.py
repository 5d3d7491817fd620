"""The Batch API's store: files (metadata and bytes), batch records and their line outcomes, and the
rq queue their chunks run on. The router's Files/Batches endpoints and the batch workers share it;
it sits on the scheduler's Redis client and key shapes and imports neither of them."""
