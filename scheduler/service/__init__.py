"""`silod serve`: the scheduler service. The scheduling process (scheduler_process, loop) runs
rounds of the core over the database's jobs and drives a backend and the data manager; API
worker processes (api_process, api/) serve the REST API; they meet only in the database (db/,
migrations/, control)."""
