// Command capstan-relay listens on an address inside a network namespace and relays
// every connection to an address in its own (the host's) namespace.
//
// A local cluster's API server listens on 127.0.0.1 of the host only; its real node runs
// in a network namespace of its own. The relay makes the API server reachable there, at
// the node's IP, for the kubelet, kube-proxy and the pods (through the `kubernetes`
// Service), without opening anything on the host. It uses only the standard library.
package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"runtime"
	"syscall"
	"time"
)

func main() {
	netns := flag.String("netns", "", "network namespace to listen in, e.g. /proc/PID/ns/net")
	listen := flag.String("listen", "", "address to listen on inside -netns, e.g. 10.0.0.2:6443")
	target := flag.String("target", "", "address to dial in this process's own namespace, e.g. 127.0.0.1:6443")
	flag.Parse()
	if *netns == "" || *listen == "" || *target == "" {
		fmt.Fprintln(os.Stderr, "capstan-relay: -netns, -listen and -target are required")
		os.Exit(2)
	}
	l, err := listenIn(*netns, *listen)
	if err != nil {
		fmt.Fprintf(os.Stderr, "capstan-relay: listen on %s in %s: %v\n", *listen, *netns, err)
		os.Exit(1)
	}
	fmt.Fprintf(os.Stderr, "capstan-relay: %s (in %s) -> %s\n", *listen, *netns, *target)
	for {
		conn, err := l.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			fmt.Fprintf(os.Stderr, "capstan-relay: accept: %v\n", err)
			time.Sleep(100 * time.Millisecond)
			continue
		}
		go relay(conn, *target)
	}
}

// listenIn opens a listener inside the network namespace at nsPath. A socket stays in
// the namespace it was made in, so only the thread that makes it has to enter it.
func listenIn(nsPath, addr string) (net.Listener, error) {
	type result struct {
		l   net.Listener
		err error
	}
	done := make(chan result, 1)
	go func() {
		// Never unlocked: the thread, left in the other namespace, ends with this
		// goroutine instead of running other goroutines.
		runtime.LockOSThread()
		ns, err := os.Open(nsPath)
		if err != nil {
			done <- result{nil, err}
			return
		}
		defer ns.Close()
		if _, _, errno := syscall.RawSyscall(sysSetns, ns.Fd(), syscall.CLONE_NEWNET, 0); errno != 0 {
			done <- result{nil, fmt.Errorf("setns: %w", errno)}
			return
		}
		l, err := net.Listen("tcp", addr)
		done <- result{l, err}
	}()
	r := <-done
	return r.l, r.err
}

func relay(client net.Conn, target string) {
	defer client.Close()
	server, err := net.DialTimeout("tcp", target, 5*time.Second)
	if err != nil {
		fmt.Fprintf(os.Stderr, "capstan-relay: dial %s: %v\n", target, err)
		return
	}
	defer server.Close()
	done := make(chan struct{}, 2)
	pipe := func(dst, src net.Conn) {
		_, _ = io.Copy(dst, src)
		// Half-close so that the other direction can still finish.
		if tcp, ok := dst.(*net.TCPConn); ok {
			_ = tcp.CloseWrite()
		}
		done <- struct{}{}
	}
	go pipe(server, client)
	go pipe(client, server)
	<-done
	<-done
}
