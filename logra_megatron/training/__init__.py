"""Training building blocks shared by the smoke job, benchmarks and the RL trainer."""
