"""Device and backend choice, the CPU redirection for megatron-core, seeding, and the machine's
resources. Import the submodules (`platform.setup`, ...): this package imports nothing itself,
so that standard-library-only parts (free_memory, run_token) load without torch or numpy."""
