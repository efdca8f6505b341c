"""The REST API of `silod serve`: thin FastAPI routes over `scheduler.service.scheduler_process.SchedulerService`."""
