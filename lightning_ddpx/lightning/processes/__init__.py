"""Starting, joining and ending the training processes, as Lightning's own launchers do, with errors that
name the process at fault.

- :mod:`.popen_launcher`: Lightning's ``popen`` launcher naming a lost process before anything is killed;
- :mod:`.restart_rendezvous`: the default process group under torchrun's restarts;
- :mod:`.process_exit`: communication threads stopped and the group destroyed at a process's exit.
"""
