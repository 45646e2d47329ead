package main

// sysSetns is setns(2)'s number; the syscall package has no name for it.
const sysSetns = 268
