"""The Django-free training driver (`driver.train`: feeds a pipeline of stages over gRPC and reports progress)
and its plan (`plan`: what it trains, torch-free). Import the module you need: the plan's readers (the control
plane's checkpoints) load neither torch nor gRPC."""
