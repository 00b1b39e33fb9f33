"""The agent on each Mac: hardware probe, engine runs in fresh processes, telemetry
and adapters shipped to the head. Arrives with the fleet (the orchestrator issue);
today `segctl train` runs the engine directly on this machine."""
